"""Several training workers (what Ray Train runs with num_workers > 1) keep one draft: a step on different
data per worker leaves identical weights on every worker, because the gradients are all-reduced.

Two real processes with torch's gloo backend, started by torch.distributed.run, each training the tiny
target's draft on its own batch through `train_step` with the draft wrapped as Ray's `prepare_model`
wraps it (DistributedDataParallel).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specserve.serving.stack import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]  # starts worker processes

WORKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from specserve.glide import blockwise_cross_mask
    from specserve.training.features import pad_rows, target_features
    from specserve.training.settings import TrainSettings
    from specserve.training.trainer import make_scheduler, new_draft, train_step

    target_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    rows = torch.randint(100, 400, (2, 16), generator=torch.Generator().manual_seed(rank)).tolist()
    input_ids = pad_rows(rows, 16, pad_id=0)  # each worker its own data
    batch = {"input_ids": input_ids, **target_features(target, input_ids, [16, 16], layer=-1)}
    settings = TrainSettings(data_dir=out, out_dir=out, model_dir=out, draft_vocab_size=None)
    draft = new_draft(settings, target, -1)
    model = DistributedDataParallel(draft)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    scheduler = make_scheduler(optimizer, 4, 0.0)
    for _ in range(2):
        train_step(model, batch, blockwise_cross_mask(16, 5), optimizer, scheduler, grad_clip=1.0)
    state = {name: tensor.contiguous() for name, tensor in draft.state_dict().items()}
    save_file(state, str(out / f"rank{rank}.safetensors"))
    dist.destroy_process_group()
    """
)


def test_two_workers_on_different_data_keep_identical_weights(tiny_target_dir, tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        str(tiny_target_dir),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    initial = _initial_draft(tiny_target_dir, tmp_path)
    moved = [name for name, tensor in first.items() if not torch.equal(tensor, initial[name])]
    assert moved  # the steps trained something
    for name, tensor in first.items():
        torch.testing.assert_close(second[name], tensor, msg=name)


def _initial_draft(target_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from specserve.training.settings import TrainSettings
    from specserve.training.trainer import new_draft

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    settings = TrainSettings(data_dir=out, out_dir=out, model_dir=out, draft_vocab_size=None)
    return dict(new_draft(settings, target, -1).state_dict())
