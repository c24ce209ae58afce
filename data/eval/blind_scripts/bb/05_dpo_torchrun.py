"""Direct Preference Optimization, written out by hand (no TRL), torchrun + DDP.

The policy is trained with DDP; the frozen reference model lives on each rank's GPU
and only runs forward passes.

    torchrun --nproc_per_node=8 05_dpo_torchrun.py --sft_model runs/qwen2.5-1.5b-sft/final \
        --dataset HuggingFaceH4/ultrafeedback_binarized --output_dir runs/qwen2.5-1.5b-dpo
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft_model", required=True)
    ap.add_argument("--dataset", default="HuggingFaceH4/ultrafeedback_binarized")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--max_prompt_len", type=int, default=512)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=100)
    return ap.parse_args()


def encode_pair(ex, tok, max_prompt_len, max_len):
    prompt = tok.apply_chat_template(ex["chosen"][:-1], tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"][-max_prompt_len:]
    out = {}
    for key in ("chosen", "rejected"):
        r_ids = tok(ex[key][-1]["content"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + r_ids)[:max_len]
        labels = ([-100] * len(p_ids) + r_ids)[:max_len]
        out[f"{key}_input_ids"] = ids
        out[f"{key}_labels"] = labels
    return out


def make_collate(pad_id):
    def collate(batch):
        # chosen rows first, then rejected rows, padded to one length so both go through one forward
        seqs = [b["chosen_input_ids"] for b in batch] + [b["rejected_input_ids"] for b in batch]
        labs = [b["chosen_labels"] for b in batch] + [b["rejected_labels"] for b in batch]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), L), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, (s, l) in enumerate(zip(seqs, labs)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, : len(l)] = torch.tensor(l)
            mask[i, : len(s)] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def sequence_logps(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    safe_labels = labels.masked_fill(~mask, 0)
    per_tok = torch.gather(logits.float().log_softmax(-1), 2, safe_labels.unsqueeze(-1)).squeeze(-1)
    return (per_tok * mask).sum(-1)


def dpo_loss(policy, reference, batch, beta):
    n = batch["input_ids"].size(0) // 2
    pi = sequence_logps(policy, batch)
    with torch.no_grad():
        ref = sequence_logps(reference, batch)
    pi_c, pi_r = pi[:n], pi[n:]
    ref_c, ref_r = ref[:n], ref[n:]
    logits = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    loss = -F.logsigmoid(logits).mean()
    reward_acc = (logits > 0).float().mean()
    margin = (logits / beta).mean()
    return loss, reward_acc.detach(), margin.detach()


@torch.no_grad()
def evaluate(policy, reference, loader, beta, device):
    policy.eval()
    stats = torch.zeros(4, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, acc, margin = dpo_loss(policy, reference, batch, beta)
        stats += torch.stack([loss.float(), acc, margin.float(), torch.ones((), device=device)])
    dist.all_reduce(stats)
    policy.train()
    return {"loss": (stats[0] / stats[3]).item(), "reward_acc": (stats[1] / stats[3]).item(),
            "margin": (stats[2] / stats[3]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.sft_model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    if rank != 0:
        dist.barrier()
    ds = load_dataset(args.dataset)
    cols = ds["train_prefs"].column_names
    fn_kwargs = {"tok": tok, "max_prompt_len": args.max_prompt_len, "max_len": args.max_len}
    train_ds = ds["train_prefs"].map(encode_pair, fn_kwargs=fn_kwargs, remove_columns=cols, num_proc=16)
    test_ds = ds["test_prefs"].select(range(2048)).map(encode_pair, fn_kwargs=fn_kwargs, remove_columns=cols)
    if rank == 0:
        dist.barrier()

    collate = make_collate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    test_sampler = DistributedSampler(test_ds, num_replicas=world, rank=rank, shuffle=False)
    test_dl = DataLoader(test_ds, batch_size=args.batch_size, sampler=test_sampler, collate_fn=collate)

    policy = AutoModelForCausalLM.from_pretrained(args.sft_model, torch_dtype=torch.bfloat16).to(device)
    policy.config.use_cache = False
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = AutoModelForCausalLM.from_pretrained(args.sft_model, torch_dtype=torch.bfloat16).to(device)
    reference.eval().requires_grad_(False)

    policy = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    total = (len(train_dl) // args.grad_accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup_ratio * total), total)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        log_f = open(os.path.join(args.output_dir, "log.jsonl"), "a")

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        policy.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync = (i + 1) % args.grad_accum == 0
            if sync:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, acc, margin = dpo_loss(policy, reference, batch, args.beta)
                (loss / args.grad_accum).backward()
            else:
                with policy.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss, acc, margin = dpo_loss(policy, reference, batch, args.beta)
                    (loss / args.grad_accum).backward()
                continue

            torch.nn.utils.clip_grad_norm_(policy.parameters(), 10.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                s = torch.stack([loss.detach().float(), acc, margin.float()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    rec = {"epoch": epoch, "step": step, "loss": s[0].item(), "reward_acc": s[1].item(),
                           "margin": s[2].item(), "lr": sched.get_last_lr()[0], "sec": time.time() - t0}
                    print(json.dumps(rec), flush=True)
                    log_f.write(json.dumps(rec) + "\n")
                    log_f.flush()

            if step % args.eval_every == 0:
                metrics = evaluate(policy, reference, test_dl, args.beta, device)
                if rank == 0:
                    print(json.dumps({"step": step, **{f"eval_{k}": v for k, v in metrics.items()}}), flush=True)

        if rank == 0:
            save_dir = os.path.join(args.output_dir, f"epoch-{epoch}")
            policy.module.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
        dist.barrier()

    if rank == 0:
        log_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
