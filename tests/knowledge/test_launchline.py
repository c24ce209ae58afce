"""The launch command a report shows: a plain `python x.py` with several GPUs visible."""

from __future__ import annotations

import time

import pytest

from assistant.knowledge.launchline import launch_scores, shows_single_process_launch

PLAIN = "export CUDA_VISIBLE_DEVICES=0,1,2,3\npython src/train.py --per_device_train_batch_size 4"


@pytest.mark.parametrize(
    "text",
    [
        PLAIN,
        "CUDA_VISIBLE_DEVICES=0,1 python3 -u train_sft.py --do_train",
        'CUDA_VISIBLE_DEVICES="0, 1" nohup python finetune.py > log.txt &',
    ],
)
def test_a_plain_python_start_with_several_gpus_points_at_the_launch(text: str) -> None:
    assert shows_single_process_launch(text)
    assert launch_scores(text) == {"launched-without-torchrun": 1.0}


@pytest.mark.parametrize(
    "text",
    [
        "CUDA_VISIBLE_DEVICES=0 python train.py",  # one GPU: nothing to launch per GPU
        "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node=2 train.py",
        "CUDA_VISIBLE_DEVICES=0,1 python -m torch.distributed.launch --nproc_per_node 2 train.py",
        "CUDA_VISIBLE_DEVICES=0,1 accelerate launch train.py",
        "CUDA_VISIBLE_DEVICES=0,1 deepspeed train.py --deepspeed ds.json",
        "CUDA_VISIBLE_DEVICES=0,1 python train.py\nmp.spawn(main, args=(2,), nprocs=2)",
        "python train.py on a machine with 4 GPUs",  # no visible-device list
    ],
)
def test_launchers_and_single_gpus_say_nothing(text: str) -> None:
    assert not shows_single_process_launch(text)
    assert launch_scores(text) == {}


def test_hostile_lines_are_bounded() -> None:
    text = ("python " * 2000 + "\n") * 5000 + "CUDA_VISIBLE_DEVICES=0,1\n"
    started = time.perf_counter()
    shows_single_process_launch(text)
    # Generous: the bound is about the work per line, not this machine's speed.
    assert time.perf_counter() - started < 10


@pytest.mark.slow
def test_the_launch_reaches_the_top_three_of_a_device_error(engine) -> None:
    report = (
        "多卡训练报错\n" + PLAIN + "\nRuntimeError: Expected all tensors to be on the same device, "
        "but found at least two devices, cuda:0 and cuda:1!"
    )
    without = engine.rank_ids(report.replace("0,1,2,3", "0"))[:3]
    with_launch = engine.rank_ids(report)[:3]
    assert "launched-without-torchrun" in with_launch
    assert with_launch.index("launched-without-torchrun") < (
        without.index("launched-without-torchrun") if "launched-without-torchrun" in without else 3
    )
