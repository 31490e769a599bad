"""Methods vLLM adds to each of its workers (`worker_extension_cls`), called with `collective_rpc`.

Loading weights through a named method needs neither a pickled function nor
`VLLM_ALLOW_INSECURE_SERIALIZATION`: the engine process only sends the method name and a file
path (msgpack), and each worker reads the tensors itself.

Importing this module (vLLM does, in every worker, before the model loads) also registers the weight
plane's gloo backend with vLLM's factory (operators/weights/vllm_gloo.py).
"""

from __future__ import annotations

from operators.weights import vllm_gloo  # noqa: F401  (registers the `streamrl_gloo` backend)


class WeightLoader:
    def load_weights_file(self, path: str) -> int:
        """Load the safetensors file at `path` (HF names) in place; the number of tensors loaded."""
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config

        named = list(load_file(path).items())
        # As vLLM's own Worker.reload_weights: layers look up the current config while loading, and
        # `reload_weights` (not `model.load_weights`) also repacks the CPU backend's linear weights.
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        return len(named)

    def weight_report(self) -> dict:
        """What the last weight-plane update checked (vllm_gloo.GlooWeightTransferEngine.report)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "report", {}) or {})
