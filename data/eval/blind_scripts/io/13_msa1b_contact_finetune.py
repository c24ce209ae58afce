"""Fine-tune the contact regression of the MSA Transformer (esm_msa1b) and its last row/column layers.

Parsing thousands of a3m files and running the diversity filter is slow, so the
tokenized, filtered MSAs are cached once per (msa_dir, depth) in --cache_dir and
reused by later runs.

    torchrun --nnodes=1 --nproc_per_node=8 13_msa1b_contact_finetune.py \
        --msa_dir data/a3m --labels data/contacts.pt --cache_dir /scratch/cache
"""
import argparse
import hashlib
import itertools
import os
import random
import string

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import esm

_DEL = str.maketrans(dict.fromkeys(string.ascii_lowercase + "."))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--msa_dir", required=True)
    p.add_argument("--labels", required=True, help="dict name -> {'contacts': LxL int8 (-1 unknown)}")
    p.add_argument("--val_names", default="data/val_names.txt")
    p.add_argument("--cache_dir", default="/scratch/cache")
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--crop", type=int, default=256)
    p.add_argument("--unfreeze_layers", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--out_dir", default="runs/msa1b_contacts")
    return p.parse_args()


def read_msa(path):
    names, seqs = [], []
    for line in open(path):
        line = line.rstrip()
        if line.startswith(">"):
            names.append(line[1:])
            seqs.append("")
        elif seqs:
            seqs[-1] += line.translate(_DEL)
    return list(zip(names, seqs))


def greedy_max_diversity(msa, depth):
    """Greedy selection of the `depth` sequences that maximise Hamming distance to those already chosen."""
    if len(msa) <= depth:
        return msa
    arr = np.array([list(s) for _, s in msa], dtype=np.bytes_).view(np.uint8)
    chosen = [0]
    min_dist = (arr != arr[0]).mean(-1)
    for _ in range(depth - 1):
        nxt = int(min_dist.argmax())
        chosen.append(nxt)
        min_dist = np.minimum(min_dist, (arr != arr[nxt]).mean(-1))
    return [msa[i] for i in sorted(chosen)]


def build_cache(msa_dir, names, depth, batch_converter):
    cache = {}
    for name in tqdm(names, desc="tokenizing MSAs", mininterval=30):
        msa = greedy_max_diversity(read_msa(os.path.join(msa_dir, name + ".a3m")), depth)
        _, _, tokens = batch_converter([msa])
        cache[name] = tokens[0].to(torch.int16)          # depth x (L+1)
    return cache


class MSAContactDataset(Dataset):
    def __init__(self, names, msa_cache, labels, crop, train):
        self.names = names
        self.msa_cache, self.labels, self.crop, self.train = msa_cache, labels, crop, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        tokens = self.msa_cache[name].long()
        contacts = self.labels[name]["contacts"].long()
        L = contacts.shape[0]
        if self.train and L > self.crop:
            s = random.randint(0, L - self.crop)
            tokens = torch.cat([tokens[:, :1], tokens[:, 1 + s:1 + s + self.crop]], 1)   # keep BOS column
            contacts = contacts[s:s + self.crop, s:s + self.crop]
        return tokens, contacts


def contact_metrics(probs, contacts, min_sep=24):
    L = contacts.shape[0]
    i, j = torch.triu_indices(L, L, min_sep, device=probs.device)
    keep = contacts[i, j] >= 0
    p, t = probs[i, j][keep], contacts[i, j][keep]
    if p.numel() == 0:
        return 0.0, 0.0, 0
    top = p.argsort(descending=True)
    return t[top[:L]].float().sum().item(), float(min(L, p.numel())), 1


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(0)

    if rank == 0:
        esm.pretrained.esm_msa1b_t12_100M_UR50S()       # fetch weights into the hub cache once
    dist.barrier()
    model, alphabet = esm.pretrained.esm_msa1b_t12_100M_UR50S()
    batch_converter = alphabet.get_batch_converter()

    labels = torch.load(args.labels, map_location="cpu")
    val_names = set(l.strip() for l in open(args.val_names) if l.strip())
    names = sorted(n for n in labels if os.path.exists(os.path.join(args.msa_dir, n + ".a3m")))

    key = hashlib.md5(f"{os.path.abspath(args.msa_dir)}:{args.depth}:{len(names)}".encode()).hexdigest()[:10]
    cache_path = os.path.join(args.cache_dir, f"msa1b_tokens_{key}.pt")
    if os.path.exists(cache_path):
        msa_cache = torch.load(cache_path)
    else:
        msa_cache = build_cache(args.msa_dir, names, args.depth, batch_converter)
        os.makedirs(args.cache_dir, exist_ok=True)
        torch.save(msa_cache, cache_path)

    train_names = [n for n in names if n not in val_names]
    val_list = [n for n in names if n in val_names]
    train_set = MSAContactDataset(train_names, msa_cache, labels, args.crop, train=True)
    val_set = MSAContactDataset(val_list, msa_cache, labels, args.crop, train=False)

    for p in model.parameters():
        p.requires_grad = False
    for p in model.contact_head.parameters():
        p.requires_grad = True
    for layer in model.layers[-args.unfreeze_layers:]:
        for p in layer.parameters():
            p.requires_grad = True
    model = DDP(model.to(device), device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (tokens, contacts) in enumerate(loader):
            tokens, contacts = tokens.to(device), contacts[0].to(device)
            is_sync_step = (it + 1) % args.accum == 0 or (it + 1) == len(loader)
            ctx = model.no_sync() if not is_sync_step else torch.enable_grad()
            with ctx:
                probs = model(tokens, return_contacts=True)["contacts"][0]
                mask = contacts >= 0
                sep = (torch.arange(mask.shape[0], device=device)[:, None]
                       - torch.arange(mask.shape[0], device=device)[None]).abs() >= 6
                m = mask & sep
                loss = F.binary_cross_entropy(probs[m].float().clamp(1e-6, 1 - 1e-6),
                                              contacts[m].float()) / args.accum
                loss.backward()
            if is_sync_step:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item() * args.accum:.4f}", flush=True)

        model.eval()
        stats = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for tokens, contacts in val_loader:
                probs = model(tokens.to(device), return_contacts=True)["contacts"][0]
                stats += torch.tensor(contact_metrics(probs, contacts[0].to(device)), device=device,
                                      dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: long-range P@L {stats[0].item() / max(stats[1].item(), 1):.4f} "
                  f"over {int(stats[2].item())} chains", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
