"""A trainer rank's state in and out: its full weights (a state dict, or the weight channel's buckets),
publishing a version to the policy store, resumable checkpoints (DeepSpeed engine state and RNG states)
and the Hugging Face export.

`StateIO` is a part of the rank class (operators/workers/train_worker.py's TrainWorker derives from it):
it reads the rank's `torch`, `deepspeed`, `engine`, `settings`, `rank`, `version`, `store`,
`joins_publish`, ROLE and SECTION, which TrainWorker sets up. Plumbing only.
"""

from __future__ import annotations

import base64
import json
import random
import time
from pathlib import Path

import numpy as np

from operators.workers.engine_steps import NonFiniteError


class StateIO:
    """Weights, publishing, checkpoints, RNG states and HF export of a trainer rank."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full fp32 weights as numpy arrays, on every rank (ZeRO-3: every rank must call it)."""
        return self._full_state_dict(everywhere=True, as_numpy=True)

    def _named_weights(self):
        """(name, tensor) for every state-dict entry, one module at a time; under ZeRO-3 each module's
        parameters are gathered for the duration (a collective: every rank must iterate it)."""
        from operators.weights import named_weights

        gathered = self.deepspeed.zero.GatheredParameters if self.settings.zero_stage == 3 else None
        return named_weights(self.engine.module, gathered)

    def _full_state_dict(self, everywhere: bool = False, as_numpy: bool = False) -> dict:
        """Full weights, each a CPU copy in the module's dtype (the training dtype: bf16 under train.dtype bf16),
        or with `as_numpy` an fp32 numpy array (numpy has no bf16). ZeRO-3: gathered module by module, and
        every rank must call it; ranks other than 0 get {} unless `everywhere`."""
        keep = everywhere or self.rank == 0 or self.settings.zero_stage != 3

        def copy(tensor):
            return tensor.float().cpu().numpy().copy() if as_numpy else tensor.detach().to("cpu", copy=True)

        return {name: copy(tensor) for name, tensor in self._named_weights() if keep}

    def weight_buckets(self):
        """The weights in the training dtype (the module's: bf16 under train.dtype bf16), bucketed."""
        from operators.host_buffers import BucketBuffers
        from operators.weights import pack_buckets

        if getattr(self, "_bucket_buffers", None) is None:  # reused from one publish to the next
            # Pinned on a GPU rank: the device-to-host copies run at DMA speed. On an H200, packing a Qwen2-7B
            # shape's 14.2 GiB of bf16 into reused pinned buffers took 0.30 s, into reused pageable ones 0.99 s
            # (benchmarks/gpu_smoke.py, results/gpu_smoke.json). The price: rank 0 keeps about two versions
            # of the weights page-locked (BucketBuffers), 2 x 14.2 GiB at 7B.
            self._bucket_buffers = BucketBuffers(pin_memory=self.device.type == "cuda")
        return pack_buckets(self._named_weights(), self.settings.weight_bucket_mb, buffers=self._bucket_buffers)

    def _publish(self) -> float:
        """Send this version's weights to the generators and publish it; the seconds this rank was held.

        Every rank under ZeRO-3 walks the modules (the gathers are collectives); rank 0 packs the buckets
        in the training dtype and, on the weight plane (`weight_transfer: gloo`), hands them to its sender,
        whose thread broadcasts them to the engines while the next step trains (operators/weight_plane.py).
        Otherwise, and for a version an evaluator will read, the buckets go to the object store and the
        store holds their manifest (operators/weights.py)."""
        start = time.perf_counter()
        if self.store is None:  # a ZeRO-3 rank other than 0: take part in the gathers, send nothing
            for _ in self._named_weights():
                pass
            return time.perf_counter() - start
        import ray

        from operators.weights import ObjectStoreTransport, non_finite

        buckets = list(self.weight_buckets())
        bad = [name for bucket in buckets for name in non_finite(bucket)]
        if bad:  # never hand NaN weights to the generators (or to a checkpoint)
            raise NonFiniteError(
                f"{self.ROLE} version {self.version} has non-finite weights ({', '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''}); it was not published. Resume from the last checkpoint "
                f"with a lower {self.SECTION}.lr or {self.SECTION}.grad_clip"
            )
        nbytes = sum(bucket.nbytes for bucket in buckets)
        self.last_publish = {"bytes": nbytes, "buckets": len(buckets), "dtype": buckets[0].dtype if buckets else ""}
        box = [None]
        if self.settings.weight_transfer == "gloo":
            self.last_publish["waited_s"] = self._weight_sender().send(self.version, buckets)
            if ray.get(self.store.wants_weights.remote(self.version)):  # an evaluator reads this one
                box = [ray.put(ObjectStoreTransport().send(buckets, check_finite=False)[0])]
        else:
            box = [ray.put(ObjectStoreTransport().send(buckets, check_finite=False)[0])]
        ray.get(self.store.publish.remote(self.version, box))
        return time.perf_counter() - start

    def _weight_sender(self):
        """Rank 0's weight-plane sender, made on the first publish."""
        sender = getattr(self, "weight_sender", None)
        if sender is None:
            from operators.weight_plane import WeightSender

            sender = self.weight_sender = WeightSender(self.store, self.settings.weight_timeout_s,
                                                       self.settings.verify_weights_every, name=self.ROLE)
        return sender

    # --- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, folder: str) -> None:
        """Every rank: DeepSpeed engine state (model, optimizer, scheduler; its shard under ZeRO)
        into folder/engine, and this rank's RNG states into folder/rng/rank_N.json."""
        folder = Path(folder)
        self.engine.save_checkpoint(
            str(folder), tag="engine", client_state={"policy_version": self.version}, save_latest=False
        )
        (folder / "rng").mkdir(parents=True, exist_ok=True)
        (folder / "rng" / f"rank_{self.rank}.json").write_text(json.dumps(self._rng_state()))

    def load_checkpoint(self, folder: str, version: int) -> int:
        """Every rank: restore the engine and RNG states; rank 0 then publishes `version` so generators
        start from the checkpoint's weights. Returns the restored policy version."""
        folder = Path(folder)
        path, client_state = self.engine.load_checkpoint(
            str(folder), tag="engine", load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed engine state in {folder / 'engine'}")
        restored = int(client_state.get("policy_version", version))
        if restored != version:
            raise ValueError(f"{folder}: engine state is policy version {restored}, the checkpoint says {version}")
        rng_file = folder / "rng" / f"rank_{self.rank}.json"
        if rng_file.is_file():
            self._set_rng_state(json.loads(rng_file.read_text()))
        self.version = version
        if self.joins_publish and version > 0:
            self._publish()
        return version

    def _rng_state(self) -> dict:
        np_state = np.random.get_state()
        return {
            "torch": base64.b64encode(self.torch.get_rng_state().numpy().tobytes()).decode(),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        }

    def _set_rng_state(self, state: dict) -> None:
        torch_state = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
        self.torch.set_rng_state(self.torch.from_numpy(torch_state))
        kind, keys, *rest = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))

    def save_pretrained(self, path: str, tokenizer: bool = False) -> str | None:
        """Write an HF checkpoint in the training dtype (the module's: its config's dtype says the same), rank 0
        writes; every rank must call it under ZeRO-3. With the model folder's tokenizer when `tokenizer` (so
        the folder loads with from_pretrained / vLLM)."""
        state = self._full_state_dict()  # every rank under ZeRO-3 (collective); {} except on rank 0
        if self.rank != 0:
            return None
        self.engine.module.save_pretrained(path, state_dict=state)
        if tokenizer:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(
                self.settings.model_path, local_files_only=True, trust_remote_code=self.settings.trust_remote_code
            ).save_pretrained(path)
        return path

