"""Methods vLLM adds to each of its workers (`worker_extension_cls`), called with `collective_rpc`.

Loading weights through a named method needs neither a pickled function nor
`VLLM_ALLOW_INSECURE_SERIALIZATION`: the engine process only sends the method name and a file
path (msgpack), and each worker reads the tensors itself.

Importing this module (vLLM does, in every worker, before the model loads) also registers the weight
plane's gloo backend and the NCCL-over-gloo backend with vLLM's factories (operators/weights/vllm_gloo.py, vllm_nccl.py).
"""

from __future__ import annotations

from operators.weights import vllm_gloo, vllm_nccl  # noqa: F401  (register the `streamrl_gloo` and `streamrl_nccl_gloo` backends)


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

    def check_weights(self, digests: dict, dtypes: dict, shapes: dict) -> dict:
        """Compare what this worker's model keeps as the trainer sent it with the trainer's digests
        (operators/weights/checksums.py applied_mismatches): {checked, mismatches}."""
        from operators.weights.checksums import applied_mismatches

        checked, bad = applied_mismatches(self.model_runner.model, digests, dtypes,
                                          {name: tuple(shape) for name, shape in shapes.items()})
        return {"checked": checked, "mismatches": bad}
