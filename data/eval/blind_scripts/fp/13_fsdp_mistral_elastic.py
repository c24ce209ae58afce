"""Elastic FSDP fine-tuning of Mistral-7B on spot capacity.

The node count floats between 2 and 4 depending on what the spot pool gives us:
    torchrun --nnodes=2:4 --nproc-per-node=8 --max-restarts=10 \
        --rdzv-id=mistral-sft --rdzv-backend=c10d --rdzv-endpoint=$RDZV_HOST:29400 \
        13_fsdp_mistral_elastic.py --config configs/mistral_sft.yaml

Checkpoints are sharded (each rank writes only its own shard), which keeps the
save time at a few seconds even for 7B parameters + Adam state.
"""
import argparse
import functools
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, default_data_collator, get_cosine_schedule_with_warmup
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer

_exit_requested = False


def _request_exit(signum, frame):
    global _exit_requested
    _exit_requested = True


def load_cfg():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    a = p.parse_args()
    with open(a.config) as f:
        return yaml.safe_load(f)


def save_sharded(model, optimizer, scheduler, train_state, ckpt_dir, rank):
    step_dir = os.path.join(ckpt_dir, f"step_{train_state['step']:06d}")
    if rank == 0:
        os.makedirs(step_dir, exist_ok=True)
    dist.barrier()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        shard = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
    torch.save(shard, os.path.join(step_dir, f"shard_rank{rank:03d}.pt"))
    dist.barrier()
    if rank == 0:
        torch.save({"scheduler": scheduler.state_dict(), **train_state}, os.path.join(step_dir, "trainer.pt"))
        with open(os.path.join(ckpt_dir, "latest.json.tmp"), "w") as f:
            json.dump({"dir": step_dir}, f)
        os.replace(os.path.join(ckpt_dir, "latest.json.tmp"), os.path.join(ckpt_dir, "latest.json"))
    dist.barrier()


def load_sharded(model, optimizer, scheduler, ckpt_dir, rank):
    marker = os.path.join(ckpt_dir, "latest.json")
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        step_dir = json.load(f)["dir"]
    shard = torch.load(os.path.join(step_dir, f"shard_rank{rank:03d}.pt"), map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(shard["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, shard["optim"]))
    trainer = torch.load(os.path.join(step_dir, "trainer.pt"), map_location="cpu")
    scheduler.load_state_dict(trainer.pop("scheduler"))
    return trainer


def main():
    cfg = load_cfg()
    signal.signal(signal.SIGTERM, _request_exit)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["seed"])

    # keep the global batch fixed no matter how many nodes joined this round
    global_bs, micro_bs = cfg["global_batch_size"], cfg["micro_batch_size"]
    assert global_bs % (micro_bs * world) == 0, f"global batch {global_bs} not divisible for world {world}"
    accum = global_bs // (micro_bs * world)

    model = AutoModelForCausalLM.from_pretrained(cfg["model"], torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={MistralDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg["warmup_steps"], cfg["max_steps"])

    data = load_from_disk(cfg["dataset"])["train"]
    sampler = DistributedSampler(data, shuffle=True, seed=cfg["seed"], drop_last=True)

    state = load_sharded(model, optimizer, scheduler, cfg["ckpt_dir"], rank)
    step = state["step"] if state else 0
    epoch = state["epoch"] if state else 0
    samples_done = state["samples_done"] if state else 0  # global samples of the current epoch
    if rank == 0 and state:
        print(f"resumed step {step} epoch {epoch} ({samples_done} samples into the epoch), world={world}")

    model.train()
    stop = torch.zeros(1, device=local_rank)
    while step < cfg["max_steps"]:
        sampler.set_epoch(epoch)
        loader = DataLoader(data, batch_size=micro_bs, sampler=sampler, collate_fn=default_data_collator,
                            num_workers=2, pin_memory=True, drop_last=True)
        batches = iter(loader)
        for _ in range(samples_done // (micro_bs * world)):
            next(batches)
        t0 = time.time()
        exhausted = False
        while step < cfg["max_steps"]:
            for _ in range(accum):
                try:
                    batch = next(batches)
                except StopIteration:
                    exhausted = True
                    break
                batch = {k: v.to(local_rank, non_blocking=True) for k, v in batch.items()}
                loss = model(**batch).loss / accum
                loss.backward()
            if exhausted:
                optimizer.zero_grad(set_to_none=True)
                break
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            samples_done += global_bs

            if step % 10 == 0:
                l = (loss.detach() * accum).float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/step world={world}", flush=True)
                    t0 = time.time()

            stop.fill_(float(_exit_requested))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() or step % cfg["save_every"] == 0 or step == cfg["max_steps"]:
                save_sharded(model, optimizer, scheduler,
                             {"step": step, "epoch": epoch, "samples_done": samples_done},
                             cfg["ckpt_dir"], rank)
            if stop.item():
                break
        if stop.item():
            if rank == 0:
                print(f"exiting at step {step} after SIGTERM", flush=True)
            break
        if exhausted:
            epoch += 1
            samples_done = 0

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
