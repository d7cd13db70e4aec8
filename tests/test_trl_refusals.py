"""What ``ReshardGRPOTrainer`` does not cover fails at construction, naming the option (no engine started);
importing :mod:`reshard.integrations.trl` imports no TRL."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_importing_the_integration_imports_no_trl():
    code = "import sys, reshard.integrations.trl; assert 'trl' not in sys.modules, 'trl imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("trl")
    from reshard.apps.toy_models import save_checkpoint

    path = str(tmp_path_factory.mktemp("trl-refusals") / "ckpt")
    save_checkpoint(path, "dense", dtype=torch.float32)
    return path


def _config(tmp_path, **overrides):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                      num_generations=2, max_steps=1, report_to=[], save_strategy="no", **overrides)


def _data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["hello world", "the quick brown fox"]})


def _reward(completions, **kwargs):
    return [0.0 for _ in completions]


@pytest.mark.parametrize("case, message", [
    ("peft", r"peft_config is not supported"),
    ("no-vllm", r"use_vllm=True"),
    ("sleep", r"vllm_enable_sleep_mode=True is not supported"),
])
def test_refused_at_construction(ckpt, tmp_path, monkeypatch, case, message):
    from reshard.integrations.trl import ReshardGRPOTrainer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {}
    if case == "peft":
        config, kwargs = _config(tmp_path, use_vllm=True, vllm_mode="colocate"), {"peft_config": object()}
    elif case == "no-vllm":
        config = _config(tmp_path)
    else:
        config = _config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    with pytest.raises(ValueError, match=message):
        ReshardGRPOTrainer(model=ckpt, reward_funcs=_reward, args=config, train_dataset=_data(), **kwargs)
