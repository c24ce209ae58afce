"""FIM fine-tuning on scraped GitHub repos with a repository-level train/val split
(no file of a validation repo is ever seen in training).

    torchrun --nproc_per_node=8 14_repo_split_fim_ddp.py --files data/github_py_files.jsonl
"""
import argparse
import collections
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bigcode/starcoderbase-1b")
    p.add_argument("--files", required=True)
    p.add_argument("--out", default="runs/sc1b-fim-reposplit")
    p.add_argument("--val_frac", type=float, default=0.02)
    p.add_argument("--seq_len", type=int, default=8192)
    p.add_argument("--fim_rate", type=float, default=0.5)
    p.add_argument("--spm_rate", type=float, default=0.5)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_files_by_repo(path):
    by_repo = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            by_repo[ex["repo_name"]].append(ex["content"])
    return by_repo


def fim(ids, pre, mid, suf, fim_rate, spm_rate):
    if len(ids) < 4 or random.random() >= fim_rate:
        return ids
    i, j = sorted(random.sample(range(len(ids) + 1), 2))
    prefix, middle, suffix = ids[:i], ids[i:j], ids[j:]
    if random.random() < spm_rate:
        return [pre, suf] + suffix + [mid] + prefix + middle
    return [pre] + prefix + [suf] + suffix + [mid] + middle


class PackedCode(Dataset):
    def __init__(self, docs, tok, seq_len, fim_rate, spm_rate):
        pre, mid, suf = tok.convert_tokens_to_ids(["<fim_prefix>", "<fim_middle>", "<fim_suffix>"])
        stream = []
        for doc in docs:
            ids = tok(doc, add_special_tokens=False)["input_ids"]
            stream += fim(ids, pre, mid, suf, fim_rate, spm_rate) + [tok.eos_token_id]
        n = len(stream) // seq_len
        self.blocks = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self):
        return self.blocks.size(0)

    def __getitem__(self, i):
        return self.blocks[i]


@torch.no_grad()
def eval_loss(net, ds, rank, world, device):
    net.eval()
    acc = torch.zeros(2, device=device)
    for i in range(rank, len(ds), world):
        x = ds[i].unsqueeze(0).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            acc[0] += net(input_ids=x, labels=x).loss.float()
        acc[1] += 1
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    by_repo = load_files_by_repo(args.files)
    repos = sorted(by_repo)
    random.shuffle(repos)
    n_val = max(1, int(len(repos) * args.val_frac))
    val_repos, train_repos = repos[:n_val], repos[n_val:]
    train_docs = [d for r in train_repos for d in by_repo[r]]
    val_docs = [d for r in val_repos for d in by_repo[r]]
    train_ds = PackedCode(train_docs, tok, args.seq_len, args.fim_rate, args.spm_rate)
    val_ds = PackedCode(val_docs, tok, args.seq_len, args.fim_rate, args.spm_rate)
    if rank == 0:
        print(f"repos train/val {len(train_repos)}/{len(val_repos)}  blocks {len(train_ds)}/{len(val_ds)}", flush=True)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = DDP(model.to(device), device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    total = math.ceil(len(loader) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.02 * total), total)

    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, x in enumerate(loader):
            x = x.to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0 or (i + 1) == len(loader)
            model.require_backward_grad_sync = sync
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            (loss / args.accum).backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f}", flush=True)
            if step % args.eval_every == 0:
                vl = eval_loss(model.module, val_ds, rank, world, device)
                if rank == 0:
                    print(f"step {step} held-out-repo loss {vl:.4f}", flush=True)
                    if vl < best:
                        best = vl
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "last"))
        tok.save_pretrained(os.path.join(args.out, "last"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
