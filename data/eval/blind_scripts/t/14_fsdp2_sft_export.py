"""
Supervised fine-tuning (chat SFT) of Qwen2.5-3B with FSDP2, used as the cold
start for our RL runs. Sharded checkpoints are written with DCP during the
run; at the end the consolidated weights are exported as a HF folder that the
GRPO / vLLM side loads directly.

    torchrun --standalone --nproc_per_node=8 14_fsdp2_sft_export.py \
        --model Qwen/Qwen2.5-3B --data HuggingFaceH4/ultrachat_200k --out ckpt/sft_q3b
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from datasets import load_dataset
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B")
    ap.add_argument("--data", default="HuggingFaceH4/ultrachat_200k")
    ap.add_argument("--out", default="ckpt/sft")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--ckpt_every", type=int, default=500)
    return ap.parse_args()


def tokenize_chat(tok, messages, max_len):
    ids, labels = [], []
    for i, m in enumerate(messages):
        text = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        prev = tok.apply_chat_template(messages[:i], tokenize=False) if i else ""
        piece = tok(text[len(prev):], add_special_tokens=False).input_ids
        ids += piece
        labels += piece if m["role"] == "assistant" else [-100] * len(piece)
    return {"input_ids": ids[:max_len], "labels": labels[:max_len]}


def pad_collate(rows, pad_id):
    L = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    lab = torch.full((len(rows), L), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        lab[i, :len(r["labels"])] = torch.tensor(r["labels"])
    return ids, lab, ((ids != pad_id) | (lab != -100)).long()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.chat_template = AutoTokenizer.from_pretrained("Qwen/Qwen2.5-3B-Instruct").chat_template
    # fp32 master weights in the sharded params, bf16 compute through the MP policy
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))

    raw = load_dataset(args.data, split="train_sft")
    ds = raw.map(lambda ex: tokenize_chat(tok, ex["messages"], args.max_len), remove_columns=raw.column_names,
                 num_proc=16)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                    collate_fn=lambda b: pad_collate(b, tok.pad_token_id))

    updates = math.ceil(len(dl) / args.grad_accum) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / updates))))

    start_update = 0
    ckpt_root = os.path.join(args.out, "dcp")
    if os.path.isdir(ckpt_root) and os.listdir(ckpt_root):
        last = max(os.listdir(ckpt_root), key=lambda d: int(d.split("_")[-1]))
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "sched": sched.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(ckpt_root, last))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        start_update = int(last.split("_")[-1])
        if rank == 0:
            print(f"resumed from {last}", flush=True)

    update, micro = 0, 0
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, labels, attn in dl:
            if update < start_update:
                micro += 1
                if micro % args.grad_accum == 0:
                    update += 1
                continue
            ids, labels, attn = ids.cuda(), labels.cuda(), attn.cuda()
            micro += 1
            boundary = micro % args.grad_accum == 0
            model.set_requires_gradient_sync(boundary)
            logits = model(input_ids=ids, attention_mask=attn).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
            (loss / args.grad_accum).backward()
            if not boundary:
                continue

            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1

            if update % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} update {update}/{updates} loss {l.item():.4f} gn {gn.item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 10:.2f}s/it", flush=True)
                    t0 = time.time()

            if update % args.ckpt_every == 0:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict()},
                         checkpoint_id=os.path.join(ckpt_root, f"update_{update}"))

    # consolidated HF export for the RL stage
    dist.barrier()
    if rank == 0:
        full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        full_sd = {k: v.to(torch.bfloat16) for k, v in full_sd.items()}
        export = os.path.join(args.out, "hf")
        model.config.use_cache = True
        model.save_pretrained(export, state_dict=full_sd, safe_serialization=True)
        tok.save_pretrained(export)
        print(f"exported to {export}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
