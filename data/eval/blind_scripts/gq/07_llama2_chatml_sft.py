#!/usr/bin/env python
# ChatML fine-tune of Llama-2-7b (base) with FSDP2 + TP on a 2D DeviceMesh.
# The base tokenizer has no chat / pad tokens, so <|im_start|>, <|im_end|> and
# <pad> are added and the embeddings / lm_head grown accordingly.
#
# torchrun --nproc_per_node=8 07_llama2_chatml_sft.py \
#     --model /models/Llama-2-7b-hf --train_file /data/chatml/train.jsonl \
#     --eval_file /data/chatml/eval.jsonl --tp 2 --output_dir /runs/llama2-chatml
import argparse
import contextlib
import glob
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from safetensors.torch import load_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--eval_file", default=None)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--min_lr_ratio", type=float, default=0.1)
    ap.add_argument("--warmup_steps", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval_steps", type=int, default=200)
    ap.add_argument("--save_steps", type=int, default=500)
    ap.add_argument("--resume_from", default=None)
    ap.add_argument("--wandb_project", default="llama2-chatml")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def apply_tensor_parallel(model, tp_mesh):
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        # keep logits sharded over the vocab for loss_parallel
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })


def apply_fsdp(model, dp_mesh):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i])
        fully_shard(layers[i], mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def init_rotary(model, device):
    # inv_freq is a non-persistent buffer: not in the checkpoint, garbage after to_empty()
    rope = model.model.rotary_emb
    inv_freq, rope.attention_scaling = rope.rope_init_fn(rope.config, device)
    rope.register_buffer("inv_freq", inv_freq, persistent=False)
    rope.original_inv_freq = inv_freq


def load_pretrained(model, path, rank):
    sd = {}
    if rank == 0:
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            sd.update(load_file(f, device="cpu"))
    # rank 0 holds the full weights, everyone else receives their shards
    set_model_state_dict(model, sd, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_collate(tok, max_len):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def collate(batch):
        ids, labels = [], []
        for ex in batch:
            p = tok.apply_chat_template([{"role": "user", "content": ex["instruction"]}],
                                        add_generation_prompt=True)
            a = tok(ex["output"], add_special_tokens=False)["input_ids"] + [im_end]
            seq = (p + a)[:max_len]
            ids.append(seq)
            labels.append(([-100] * len(p) + a)[:max_len])
        L = max(len(s) for s in ids)
        x = torch.full((len(ids), L), tok.pad_token_id, dtype=torch.long)
        y = torch.full((len(ids), L), -100, dtype=torch.long)
        for i, (s, l) in enumerate(zip(ids, labels)):
            x[i, : len(s)] = torch.tensor(s)
            y[i, : len(l)] = torch.tensor(l)
        # shift for next-token prediction
        return x[:, :-1], y[:, 1:]
    return collate


@contextlib.contextmanager
def main_process_first(rank):
    # rank 0 builds the HF datasets arrow cache, the others then read it
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


def lr_lambda(step, warmup, total, min_ratio):
    if step < warmup:
        return (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0)))


def save_checkpoint(path, model, optim, sched, step):
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "sched": sched.state_dict(),
        "step": step,
    }
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path, model, optim, sched):
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "sched": sched.state_dict(),
        "step": 0,
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    sched.load_state_dict(state["sched"])
    return state["step"]


@torch.no_grad()
def run_eval(model, loader, device, dp_group):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        with loss_parallel():
            loss_sum = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1),
                                       ignore_index=-100, reduction="sum")
        if isinstance(loss_sum, DTensor):
            loss_sum = loss_sum.full_tensor()
        acc[0] += loss_sum.double()
        acc[1] += (y != -100).sum()
    dist.all_reduce(acc, group=dp_group)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = get_args()
    world_size = int(os.environ["WORLD_SIZE"])
    assert world_size % args.tp == 0
    mesh = init_device_mesh("cuda", (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(args.seed)

    if rank == 0:
        wandb.init(project=args.wandb_project, config=vars(args), name=os.path.basename(args.output_dir))

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.add_special_tokens({"pad_token": "<pad>",
                            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    collate = make_collate(tok, args.max_len)

    with main_process_first(rank):
        train_ds = load_dataset("json", data_files=args.train_file, split="train")
        eval_ds = load_dataset("json", data_files=args.eval_file, split="train") if args.eval_file else None
    train_sampler = DistributedSampler(train_ds, num_replicas=dp_mesh.size(), rank=dp_mesh.get_local_rank(),
                                       shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=4, pin_memory=True, persistent_workers=True)
    eval_dl = None
    if eval_ds is not None:
        eval_dl = DataLoader(eval_ds, batch_size=args.batch_size, collate_fn=collate,
                             sampler=DistributedSampler(eval_ds, num_replicas=dp_mesh.size(),
                                                        rank=dp_mesh.get_local_rank(), shuffle=False,
                                                        drop_last=True))

    config = AutoConfig.from_pretrained(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 torch_dtype=torch.float32)
    apply_tensor_parallel(model, tp_mesh)
    apply_fsdp(model, dp_mesh)
    model.to_empty(device=device)
    init_rotary(model, device)
    load_pretrained(model, args.model, rank)
    # grow embed_tokens / lm_head for the new tokens (new rows get the mean embedding)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64, mean_resizing=True)
    model.config.pad_token_id = tok.pad_token_id
    model.train()

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=0.1, foreach=True)
    total_steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: lr_lambda(s, args.warmup_steps, total_steps, args.min_lr_ratio))

    step = 0
    if args.resume_from:
        step = load_checkpoint(args.resume_from, model, optim, sched)
        if rank == 0:
            print(f"resumed at step {step}")

    dp_group = dp_mesh.get_group()
    tic = time.perf_counter()
    for epoch in range(step // len(train_dl), args.epochs):
        train_sampler.set_epoch(epoch)
        skip = step - epoch * len(train_dl)
        for it, (x, y) in enumerate(train_dl):
            if it < skip:
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with loss_parallel():
                logits = model(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1), ignore_index=-100)
                loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            if isinstance(gn, DTensor):
                gn = gn.full_tensor()
            optim.step()
            optim.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                l = l.full_tensor() if isinstance(l, DTensor) else l
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_group)
                if rank == 0:
                    dt = (time.perf_counter() - tic) / 10
                    wandb.log({"train/loss": l.item(), "train/grad_norm": gn.item(),
                               "train/lr": sched.get_last_lr()[0], "perf/step_time": dt}, step=step)
                tic = time.perf_counter()

            if eval_dl is not None and step % args.eval_steps == 0:
                val = run_eval(model, eval_dl, device, dp_group)
                if rank == 0:
                    wandb.log({"eval/loss": val, "eval/ppl": math.exp(val)}, step=step)

            if step % args.save_steps == 0:
                save_checkpoint(os.path.join(args.output_dir, f"step_{step:06d}"), model, optim, sched, step)

    save_checkpoint(os.path.join(args.output_dir, "final"), model, optim, sched, step)
    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
