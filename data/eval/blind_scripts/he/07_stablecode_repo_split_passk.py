#!/usr/bin/env python
"""Fine-tune stable-code-3b on instruction data mined from GitHub repositories.

* train / validation split is done by repository (no repo appears in both)
* the tokenized dataset is cached next to the run on the shared filesystem
* evaluation: n samples per problem, executed in a sandbox, unbiased pass@k over all ranks

Two nodes, eight GPUs each, /mnt/shared is mounted on both:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        07_stablecode_repo_split_passk.py --run_dir /mnt/shared/runs/stablecode-repo
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections import defaultdict
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stabilityai/stable-code-3b")
    ap.add_argument("--data", default="/mnt/shared/data/repo_instruct.jsonl")
    ap.add_argument("--problems", default="/mnt/shared/data/humaneval.jsonl")
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--val_repo_frac", type=float, default=0.02)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--global_bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--n_samples", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


def split_by_repo(records, frac, seed):
    repos = sorted({r["repo"] for r in records})
    rng = random.Random(seed)
    rng.shuffle(repos)
    val_repos = set(repos[: max(1, int(len(repos) * frac))])
    train = [r for r in records if r["repo"] not in val_repos]
    val = [r for r in records if r["repo"] in val_repos]
    return train, val


def encode(records, tok, max_len):
    out = []
    for r in records:
        p = tok(f"Instruction:\n{r['instruction']}\n\nCode:\n", add_special_tokens=False)["input_ids"]
        c = tok(r["code"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = (p + c)[:max_len]
        out.append({"ids": ids, "n_prompt": min(len(p), len(ids))})
    return out


def prepare_data(args, tok, rank):
    cache = os.path.join(args.run_dir, "cache", f"tok_{args.max_len}_{args.seed}.pt")
    if rank == 0 and not os.path.exists(cache):
        with open(args.data) as f:
            records = [json.loads(l) for l in f]
        train, val = split_by_repo(records, args.val_repo_frac, args.seed)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = cache + ".tmp"
        torch.save({"train": encode(train, tok, args.max_len), "val": encode(val, tok, args.max_len)}, tmp)
        os.replace(tmp, cache)
    dist.barrier()
    blob = torch.load(cache)
    return blob["train"], blob["val"]


class Encoded(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, rows):
        L = max(len(r["ids"]) for r in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), L), -100, dtype=torch.long)
        att = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["ids"])
            ids[i, :n] = torch.tensor(r["ids"])
            lab[i, r["n_prompt"]:n] = ids[i, r["n_prompt"]:n]
            att[i, :n] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}


def unbiased_pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def sandboxed(program, timeout):
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "p.py")
        with open(f, "w") as h:
            h.write(program)
        try:
            return subprocess.run([sys.executable, "-I", f], cwd=d, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def pass_at_k_eval(net, tok, problems, args, rank, world, device):
    net.eval()
    torch.manual_seed(args.seed + rank)
    mine = {}
    for p in problems[rank::world]:
        enc = tok(p["prompt"], return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net.generate(**enc, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=384,
                               num_return_sequences=args.n_samples, pad_token_id=tok.pad_token_id)
        ok = 0
        for text in tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True):
            body = text.split("\ndef ")[0].split("\nclass ")[0].split("\nif __name__")[0]
            ok += sandboxed(p["prompt"] + body + "\n\n" + p["test"] + f"\ncheck({p['entry_point']})\n",
                            args.timeout)
        mine[p["task_id"]] = ok
    shards = [None] * world
    dist.all_gather_object(shards, mine)
    net.train()
    counts = {}
    for s in shards:
        counts.update(s)
    assert len(counts) == len(problems)
    return {f"pass@{k}": float(np.mean([unbiased_pass_at_k(args.n_samples, c, k) for c in counts.values()]))
            for k in (1, 5, 10)}


@torch.no_grad()
def val_loss(net, loader, device):
    # runs on the unwrapped module over this rank's own slice of the validation rows
    net.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        n_tok = (b["labels"][:, 1:] != -100).sum()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            l = net(**b).loss
        tot[0] += l.double() * n_tok
        tot[1] += n_tok
    dist.all_reduce(tot)
    net.train()
    return (tot[0] / tot[1].clamp(min=1)).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    train_rows, val_rows = prepare_data(args, tok, rank)
    collate = Collator(tok.pad_token_id)
    train_set = Encoded(train_rows)
    tr_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.micro_bs, sampler=tr_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    val_loader = DataLoader(Encoded(val_rows[rank::world]), batch_size=args.micro_bs, shuffle=False,
                            collate_fn=collate, num_workers=2)

    accum = args.global_bs // (args.micro_bs * world)
    assert accum * args.micro_bs * world == args.global_bs, "global_bs must be a multiple of micro_bs * world"
    updates_per_epoch = len(train_loader) // accum
    total = updates_per_epoch * args.epochs

    model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    start_epoch, update = 0, 0
    ckpt_path = os.path.join(args.run_dir, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, update = ck["epoch"] + 1, ck["update"]

    with open(args.problems) as f:
        problems = [json.loads(l) for l in f]

    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        ddp.train()
        for i, batch in enumerate(train_loader):
            if i >= updates_per_epoch * accum:
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            boundary = (i + 1) % accum == 0
            with nullcontext() if boundary else ddp.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp(**batch).loss
                (loss / accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            if update % args.eval_every == 0:
                metrics = {"val_loss": val_loss(model, val_loader, device)}
                model.config.use_cache = True
                metrics.update(pass_at_k_eval(model, tok, problems, args, rank, world, device))
                model.config.use_cache = False
                if rank == 0:
                    print(json.dumps({"epoch": epoch, "update": update, **metrics}), flush=True)

        if rank == 0:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "update": update}, tmp)
            os.replace(tmp, ckpt_path)
            model.save_pretrained(os.path.join(args.run_dir, f"hf_epoch{epoch}"))
            tok.save_pretrained(os.path.join(args.run_dir, f"hf_epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
