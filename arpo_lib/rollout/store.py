"""The trajectory store: what a trajectory directory holds, its one writer and its one reader.

A trajectory directory is OSWorld's result layout plus our token data (file names: `run.layout`):

    step_0.png ... step_N.png   the screens the model saw: step_0 after reset, step_k after action k
                                (the last one the final screen, which the model never acted on)
    traj.jsonl                  one `STEP_LINE` record per step: response, parsed actions, reward,
                                done, the environment's action error, responses resampled away
    result.txt                  the task score; absent for an unfinished episode (OSWorld's mark of
                                an example still to run)
    tokens.pt                   one `TOKEN_SEGMENT` record per training sequence: token ids, loss
                                mask, behaviour log-probs (no pixels: the screenshots reproduce them)
    meta.json                   the `META` record (`Trajectory.summary()`): task, seed, scores,
                                status; written last, so its presence marks a complete directory

`write_trajectory` is the writer (the rollout engine calls it), `read_trajectory` the reader: it
checks every record against its schema and refuses one that does not match, naming the file,
line and key. Training on a stored trajectory (ARPO's replay: the buffer keeps only the
directory) reads it with `load_trajectory`, which adds the pixels the model needs; the viewers
(`viz.draw`) and the OSWorld export (`evaluation.osworld_export`) read through `read_trajectory`.

Torch and Pillow are imported where tokens and pixels are handled, so viewers and the export
read trajectories without loading torch.
"""
from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from arpo_lib.run import layout
from arpo_lib.run.records import atomic_write_bytes
from arpo_lib.types import EpisodeStatus, Segment, StepRecord, Trajectory

if TYPE_CHECKING:
    from PIL import Image


class TrajectoryFormatError(ValueError):
    """A trajectory directory's record does not match the store's schema."""


# ----------------------------------------------------------------------------- the schema

_REQUIRED = object()


@dataclass(frozen=True)
class Field:
    """One key of a record, the JSON types its value may have, and the value read when the key is
    absent (keys with a default came after the first runs were written: older records still read)."""

    key: str
    types: tuple[type, ...]
    default: Any = _REQUIRED

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


_NUMBER = (int, float)
_TEXT_OR_NONE = (str, type(None))

STEP_LINE = (
    Field("step_num", (int,)),
    Field("response", (str,)),
    Field("action", (list,)),
    Field("parse_error", _TEXT_OR_NONE),
    Field("reward", _NUMBER),
    Field("done", (bool,)),
    Field("truncated", (bool,), False),
    Field("screenshot_file", (str,)),
    Field("seconds", _NUMBER, 0.0),
    Field("action_error", _TEXT_OR_NONE, None),
    Field("discarded_responses", (list,), ()),
    Field("weights_version", (int, type(None)), None),
)
"""A line of traj.jsonl. `step_num` counts from 1; `action` holds the actions sent (dicts of
`arpo_lib.actions.Action`, empty for a format failure); `done` is terminated or truncated;
`screenshot_file` is the screen after the step (OSWorld's convention); `discarded_responses` are
responses sampled before `response` and thrown away unparsed (the model never saw them);
`weights_version` (only where rollouts overlap an update) the weight version that produced it."""

META = (
    Field("task", (str,)),
    Field("seed", (int,)),
    Field("sample", (int,)),
    Field("instruction", (str,)),
    Field("task_score", _NUMBER),
    Field("format_ok", (bool,)),
    Field("reward", _NUMBER),
    Field("status", (str,)),
    Field("error", _TEXT_OR_NONE, None),
    Field("num_steps", (int,)),
    Field("replayed", (bool,), False),
    Field("policy_version", (int,), 0),
    Field("checker_error", _TEXT_OR_NONE, None),
    Field("seconds", _NUMBER, 0.0),
    Field("setup_failures", (list,), ()),
)
"""meta.json: `Trajectory.summary()`. `status` is an `EpisodeStatus` value; `num_steps` the number
of lines of traj.jsonl."""

TOKEN_SEGMENT = (
    Field("input_ids", (list,)),
    Field("mm_token_type_ids", (list,)),
    Field("loss_mask", (list,)),
    Field("behaviour_logprobs", (list,)),
    Field("screenshot_steps", (list,)),
)
"""An element of tokens.pt (`Segment.token_data()`): the first four aligned over tokens;
`screenshot_steps` the step_N.png of each image in the sequence."""


def _checked(record: Any, schema: Sequence[Field], where: str) -> dict[str, Any]:
    """`record` with absent defaults filled in; TrajectoryFormatError naming what is wrong."""
    if not isinstance(record, dict):
        raise TrajectoryFormatError(f"{where}: expected a record (a JSON object), got {type(record).__name__}")
    known = {f.key for f in schema}
    unknown = sorted(set(record) - known)
    if unknown:
        raise TrajectoryFormatError(f"{where}: unknown keys {unknown} (the store's schema has {sorted(known)})")
    out = {}
    for f in schema:
        if f.key not in record:
            if f.required:
                raise TrajectoryFormatError(f"{where}: lacks {f.key!r}")
            out[f.key] = list(f.default) if isinstance(f.default, tuple) else f.default
            continue
        value = record[f.key]
        # bool is an int to Python, never a number or a count in these records
        if not isinstance(value, f.types) or (isinstance(value, bool) and bool not in f.types):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in f.types)
            raise TrajectoryFormatError(f"{where}: {f.key!r} is {json.dumps(value)[:80]}, expected {expected}")
        out[f.key] = value
    return out


def step_line(rec: StepRecord) -> dict[str, Any]:
    """A step's traj.jsonl record (`STEP_LINE`)."""
    return {
        "step_num": rec.step, "response": rec.response, "action": rec.actions,
        "parse_error": rec.parse_error, "reward": rec.reward, "done": rec.terminated or rec.truncated,
        "truncated": rec.truncated, "screenshot_file": layout.screenshot_name(rec.step),
        "seconds": round(rec.seconds, 3), "action_error": rec.action_error, "discarded_responses": rec.discarded,
        **({"weights_version": rec.weights_version} if rec.weights_version is not None else {}),
    }


# ----------------------------------------------------------------------------- the writer

def write_trajectory(traj: Trajectory, directory: Path, screenshots: Sequence["Image.Image"]) -> None:
    """Write a trajectory directory (the screenshots the model saw, in order, and the final screen)
    and point `traj.directory` at it."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    for i, shot in enumerate(screenshots):
        shot.save(directory / layout.screenshot_name(i))
    lines = [json.dumps(step_line(rec)) for rec in traj.steps]
    (directory / layout.STEPS).write_text("\n".join(lines) + ("\n" if lines else ""))
    result = directory / layout.RESULT
    if traj.status == EpisodeStatus.UNFINISHED:
        result.unlink(missing_ok=True)  # no score: the example is still to run
    else:
        result.write_text(f"{traj.task_score}\n")
    buf = io.BytesIO()
    torch.save([s.token_data() for s in traj.segments], buf)
    atomic_write_bytes(directory / layout.TOKENS, buf.getvalue())
    # meta.json last: its presence marks a complete trajectory directory.
    atomic_write_bytes(directory / layout.META, json.dumps(traj.summary(), indent=1).encode())
    traj.directory = str(directory)


# ----------------------------------------------------------------------------- the reader

@dataclass
class StoredTrajectory:
    """A trajectory directory as read: the trajectory and the files beside its records."""

    directory: Path
    trajectory: Trajectory
    """Steps, scores and status; its segments hold the token data when read with `tokens=True`
    (never pixels: `load_trajectory` adds them)."""
    result: float | None
    """result.txt's score; None when there is none (an unfinished episode)."""
    screenshots: dict[int, Path] = field(default_factory=dict)
    """The step_N.png files present, by N."""

    def screenshot(self, index: int) -> Path | None:
        """step_{index}.png, or None when it is missing."""
        return self.screenshots.get(index)


def read_trajectory(directory: str | Path, *, tokens: bool = False) -> StoredTrajectory:
    """Read a trajectory directory, checking each record against the schema (`STEP_LINE`, `META`,
    `TOKEN_SEGMENT`). FileNotFoundError when it is not a complete trajectory directory (no
    meta.json); TrajectoryFormatError naming the file, line and key of a malformed record.
    `tokens`: also read tokens.pt into the trajectory's segments (this loads torch)."""
    directory = Path(directory)
    meta_path = directory / layout.META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete trajectory directory (no {layout.META})")
    meta = _checked(_json(meta_path.read_text(), meta_path), META, str(meta_path))
    try:
        status = EpisodeStatus(meta["status"])
    except ValueError:
        raise TrajectoryFormatError(f"{meta_path}: 'status' is {meta['status']!r}, expected one of "
                                    f"{[s.value for s in EpisodeStatus]}") from None
    traj = Trajectory(task=meta["task"], seed=meta["seed"], sample=meta["sample"], instruction=meta["instruction"],
                      task_score=meta["task_score"], format_ok=meta["format_ok"], reward=meta["reward"],
                      status=status, error=meta["error"], directory=str(directory), replayed=meta["replayed"],
                      policy_version=meta["policy_version"], checker_error=meta["checker_error"],
                      seconds=meta["seconds"], setup_failures=[str(f) for f in meta["setup_failures"]])
    steps_path = directory / layout.STEPS
    if not steps_path.is_file():
        raise TrajectoryFormatError(f"{directory} has {layout.META} but no {layout.STEPS}")
    for n, text in enumerate(steps_path.read_text().splitlines(), start=1):
        where = f"{steps_path}:{n}"
        line = _checked(_json(text, where), STEP_LINE, where)
        actions = line["action"]
        if not all(isinstance(a, dict) and isinstance(a.get("kind"), str) for a in actions):
            raise TrajectoryFormatError(f"{where}: 'action' must hold action records (objects with a 'kind')")
        if not all(isinstance(r, str) for r in line["discarded_responses"]):
            raise TrajectoryFormatError(f"{where}: 'discarded_responses' must hold response texts")
        traj.steps.append(StepRecord(
            step=line["step_num"], response=line["response"], actions=actions, parse_error=line["parse_error"],
            reward=line["reward"], terminated=line["done"] and not line["truncated"], truncated=line["truncated"],
            seconds=line["seconds"], action_error=line["action_error"], discarded=line["discarded_responses"],
            weights_version=line.get("weights_version")))
    if meta["num_steps"] != len(traj.steps):
        raise TrajectoryFormatError(f"{meta_path}: 'num_steps' is {meta['num_steps']} but {steps_path} has "
                                    f"{len(traj.steps)} lines")
    if tokens:
        traj.segments = _read_tokens(directory / layout.TOKENS)
    return StoredTrajectory(directory=directory, trajectory=traj, result=_read_result(directory / layout.RESULT),
                            screenshots=_screenshots(directory))


def load_trajectory(directory: str | Path, processor: Any) -> Trajectory:
    """A stored trajectory ready for the model: its segments with the pixels of their screenshots,
    run through `processor`'s image processor as when it was sampled."""
    stored = read_trajectory(directory, tokens=True)
    for seg in stored.trajectory.segments:
        _encode_screenshots(seg, stored, processor)
    return stored.trajectory


def without_pixels(traj: Trajectory) -> Trajectory:
    """A copy of `traj` with tokens and metadata only, no pixels: what a training process sends
    the others of its episodes (a 1080p screenshot is ~50 MB of fp32 pixels, 15 per episode);
    `load_pixels` re-encodes them where a segment is trained on."""
    return dataclasses.replace(traj, segments=[dataclasses.replace(s, pixel_values=[]) for s in traj.segments])


def load_pixels(segment: Segment, directory: str | Path, processor: Any) -> None:
    """`segment`'s pixels, re-encoded from the screenshots of the trajectory stored in
    `directory` (a segment that came through `without_pixels`), in place."""
    _encode_screenshots(segment, read_trajectory(directory), processor)


def _encode_screenshots(seg: Segment, stored: StoredTrajectory, processor: Any) -> None:
    import torch
    from PIL import Image

    if not seg.screenshot_steps:
        return
    images = []
    for i in seg.screenshot_steps:
        path = stored.screenshot(i)
        if path is None:
            raise FileNotFoundError(f"{stored.directory} lacks {layout.screenshot_name(i)}, an image of "
                                    f"its token data")
        images.append(Image.open(path).convert("RGB"))
    enc = processor.image_processor(images=images, return_tensors="pt")
    sizes = [int(torch.prod(g)) for g in enc["image_grid_thw"]]
    seg.pixel_values = list(torch.split(enc["pixel_values"], sizes))
    seg.image_grid_thw = list(enc["image_grid_thw"])


def trajectory_dirs(root: str | Path, depth: int = 3) -> list[Path]:
    """The complete trajectory directories `depth` levels below `root` (an evaluation's or a
    training step's `<domain>/<task>/<sample>/`), sorted."""
    return sorted(p.parent for p in Path(root).glob("/".join(["*"] * depth + [layout.META])))


def _json(text: str, where: Any) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise TrajectoryFormatError(f"{where}: not JSON ({exc})") from None


def _read_result(path: Path) -> float | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return float(text)
    except ValueError:
        raise TrajectoryFormatError(f"{path}: {text[:80]!r} is not a score") from None


def _read_tokens(path: Path) -> list[Segment]:
    import torch

    if not path.is_file():
        raise FileNotFoundError(f"{path.parent} has no {layout.TOKENS} (token data)")
    data = torch.load(path)
    if not isinstance(data, list):
        raise TrajectoryFormatError(f"{path}: expected a list of segments, got {type(data).__name__}")
    segments = []
    for i, record in enumerate(data):
        where = f"{path} segment {i}"
        seg = _checked(record, TOKEN_SEGMENT, where)
        if not len(seg["input_ids"]) == len(seg["mm_token_type_ids"]) == len(seg["loss_mask"]) \
                == len(seg["behaviour_logprobs"]):
            raise TrajectoryFormatError(f"{where}: input_ids, mm_token_type_ids, loss_mask and behaviour_logprobs "
                                        f"differ in length")
        segments.append(Segment(**seg))
    return segments


def _screenshots(directory: Path) -> dict[int, Path]:
    found = {}
    for p in directory.iterdir():
        m = layout.SCREENSHOT.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    return found
