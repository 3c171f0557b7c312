"""A vLLM worker extension for weight sync; it runs inside vLLM's server, in vLLM's environment.

Loaded with `--worker-extension-cls arpo_vllm_ext.WeightSyncExtension` (this directory on the
server's PYTHONPATH; `arpo_lib.serving.launch.start_server(..., weight_sync=True)` does both). The
trainer calls it through vLLM's dev endpoint `POST /collective_rpc` with
`{"method": "arpo_reload_weights", "kwargs": {"weights_path": DIR}}`.

Why not vLLM's own `reload_weights` alone: on the CPU backend, a model whose output layer is tied
to its input embedding keeps a separately packed copy of the output weights that `reload_weights`
does not refresh, so the reloaded server silently samples from the old output layer. Re-running
the embedding's post-load processing repacks it. On GPU the extra step finds nothing to do.

Standalone on purpose: it must not import arpo_lib (torch and transformers differ there).
"""
from __future__ import annotations


class WeightSyncExtension:
    """Mixed into vLLM's worker class: `self` is the worker (model_runner, reload_weights)."""

    def arpo_reload_weights(self, weights_path: str | None = None) -> int:
        """Reload the weights from `weights_path` (a model directory with safetensors) in place;
        returns how many packed output layers were refreshed."""
        if weights_path:
            self.reload_weights(weights_path=weights_path)
        else:
            self.reload_weights()
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        refreshed = 0
        for module in self.model_runner.get_model().modules():
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
        return refreshed
