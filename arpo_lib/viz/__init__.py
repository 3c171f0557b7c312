"""Looking at runs: pure renderers (`draw`), static trajectory figures (`filmstrips`), notebook widgets
over them (`widgets`), plots of
metrics and evaluations (`plots`), of a study's selections and comparisons (`study_plots`, also
reachable as `plots.plot_comparison`, ...), what every figure shares (`figures`), and a comparison's
report as text (`report`: report.md and the digest nbval compares).

    from arpo_lib import viz
    viz.show_trajectory(traj_dir)         # step viewer + static filmstrip
    viz.show_group(run_dir)               # the G rollouts of a task side by side
    viz.plots.plot_training(run_dir)      # curves
"""
from arpo_lib.viz import plots
from arpo_lib.viz.draw import Frame, draw_actions, list_groups, load_frames, load_group
from arpo_lib.viz.filmstrips import filmstrip, group_figure
from arpo_lib.viz.widgets import GroupView, StepViewer, show_group, show_trajectory

__all__ = ["Frame", "GroupView", "StepViewer", "draw_actions", "filmstrip", "group_figure", "list_groups",
           "load_frames", "load_group", "plots", "show_group", "show_trajectory"]
