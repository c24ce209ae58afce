"""Multi-turn chat SFT of Llama-3.1-8B-Instruct, TP x FSDP2 on a 2D DeviceMesh.

Tokenized data is cached with save_to_disk() so restarts / sweeps skip the
(slow) chat-template tokenization. Only assistant turns are supervised.

    torchrun --nproc_per_node=8 04_llama31_chat_sft_cached.py \
        --model meta-llama/Llama-3.1-8B-Instruct --data /data/chat/sharegpt_clean.jsonl \
        --tp 2 --out /ckpt/l31-8b-chat
"""
import argparse
import json
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from datasets import load_dataset, load_from_disk
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE = -100


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--max_len", type=int, default=4096)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval_frac", type=float, default=0.01)
    p.add_argument("--eval_every", type=int, default=300)
    p.add_argument("--save_every", type=int, default=600)
    p.add_argument("--num_proc", type=int, default=16)
    p.add_argument("--cache_dir", default="/data/cache/tokenized")
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def tokenize(ex, tok, max_len):
    # render the conversation prefix by prefix so each turn's tokens can be attributed
    msgs, prev, labels = ex["messages"], [], []
    for k in range(len(msgs)):
        cur = tok.apply_chat_template(msgs[: k + 1], tokenize=True)
        piece = cur[len(prev):]
        labels += piece if msgs[k]["role"] == "assistant" else [IGNORE] * len(piece)
        prev = cur
    return {"input_ids": prev[:max_len], "labels": labels[:max_len]}


def collate(batch, pad_id):
    L = max(len(b["input_ids"]) for b in batch)
    x = torch.full((len(batch), L), pad_id)
    y = torch.full((len(batch), L), IGNORE)
    for i, b in enumerate(batch):
        x[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
        y[i, : len(b["labels"])] = torch.tensor(b["labels"])
    return x, y


def shard_model(model, mesh):
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)


def build_datasets(args, tok):
    name = f"{os.path.basename(args.model.rstrip('/'))}-{os.path.basename(args.data)}-L{args.max_len}"
    cache = os.path.join(args.cache_dir, name)
    if os.path.isdir(cache):
        split = load_from_disk(cache)
    else:
        raw = load_dataset("json", data_files=args.data, split="train")
        ds = raw.map(partial(tokenize, tok=tok, max_len=args.max_len), remove_columns=raw.column_names,
                     num_proc=args.num_proc, desc="tokenize")
        ds = ds.filter(lambda ex: any(l != IGNORE for l in ex["labels"][1:]), num_proc=args.num_proc)
        split = ds.train_test_split(test_size=args.eval_frac, seed=args.seed)
        split.save_to_disk(cache)
    return split["train"], split["test"]


@torch.no_grad()
def evaluate(model, loader, device, dp_group):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(input_ids=x, labels=y)
        n = (y[:, 1:] != IGNORE).sum()
        s += torch.stack([out.loss.double() * n, n.double()])
    dist.all_reduce(s, group=dp_group)
    model.train()
    return (s[0] / s[1].clamp(min=1)).item()


def main():
    args = parse()
    ws = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cuda", (ws // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_mesh = mesh["dp"]
    dp_group, dp_rank, dp_size = dp_mesh.get_group(), dp_mesh.get_local_rank(), dp_mesh.size()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)

    train_ds, eval_ds = build_datasets(args, tok)
    if rank == 0:
        print(f"train {len(train_ds)} / eval {len(eval_ds)} conversations", flush=True)

    coll = partial(collate, pad_id=tok.pad_token_id)
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=coll,
                        num_workers=4, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=args.bs, collate_fn=coll,
                             sampler=DistributedSampler(eval_ds, num_replicas=dp_size, rank=dp_rank,
                                                        shuffle=False, drop_last=True))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    shard_model(model, mesh)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=True)
    total = args.epochs * len(loader)
    warm = max(1, int(args.warmup_ratio * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))

    step = 0
    ckpt_dir = os.path.join(args.out, "dcp")
    meta = os.path.join(args.out, "trainer_state.json")
    if os.path.exists(meta):
        with open(meta) as f:
            step = json.load(f)["step"]
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, f"step{step}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for _ in range(step):
            sched.step()

    model.train()
    t0 = time.time()
    for epoch in range(step // len(loader), args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * len(loader) + i < step:
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            gn = gn.full_tensor() if isinstance(gn, DTensor) else gn
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                stats = torch.stack([loss.detach().float(), gn.float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG, group=dp_group)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {stats[0]:.4f} gnorm {stats[1]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.3e} {(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                ev = evaluate(model, eval_loader, device, dp_group)
                if rank == 0:
                    print(f"step {step} eval_loss {ev:.4f}", flush=True)

            if step % args.save_every == 0:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ckpt_dir, f"step{step}"))
                if rank == 0:
                    with open(meta, "w") as f:
                        json.dump({"step": step}, f)

    # full weights for from_pretrained(); the gather is collective, only rank 0 writes
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        hf_dir = os.path.join(args.out, "hf")
        model.config.use_cache = True
        model.config.save_pretrained(hf_dir)
        tok.save_pretrained(hf_dir)
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(hf_dir, "model.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
