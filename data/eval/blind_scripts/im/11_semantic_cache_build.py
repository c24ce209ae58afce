"""
LC-Rec / TIGER style training on the full Amazon-2023 category. Preprocessing (filtering,
5-core, mapping ASINs to semantic IDs, building sliding-window examples) takes ~20 min,
so the processed tensors are cached next to the raw data.

  torchrun --nproc_per_node=8 11_semantic_cache_build.py --raw data/amazon23/Books --sem artifacts/books/sem_ids.json
"""
import argparse
import gzip
import hashlib
import json
import os
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import T5Config, T5ForConditionalGeneration, get_cosine_schedule_with_warmup

PAD, EOS = 0, 1


def five_core(events):
    while True:
        uc = Counter(u for u, _, _ in events)
        ic = Counter(i for _, i, _ in events)
        kept = [e for e in events if uc[e[0]] >= 5 and ic[e[1]] >= 5]
        if len(kept) == len(events):
            return kept
        events = kept


def preprocess(raw_dir, sem, K, max_items, show_progress):
    events = []
    with gzip.open(os.path.join(raw_dir, "reviews.jsonl.gz"), "rt") as f:
        for line in tqdm(f, disable=not show_progress, desc="reading"):
            r = json.loads(line)
            if r["parent_asin"] in sem:
                events.append((r["user_id"], r["parent_asin"], r["timestamp"]))
    events = five_core(events)
    by_user = defaultdict(list)
    for u, i, ts in events:
        by_user[u].append((ts, i))

    def toks(asin):
        return [2 + l * K + c for l, c in enumerate(sem[asin])]

    out = {"train": [], "valid": [], "test": []}
    for u in sorted(by_user):
        seq = [i for _, i in sorted(by_user[u])]
        for t in range(1, len(seq)):
            split = "test" if t == len(seq) - 1 else "valid" if t == len(seq) - 2 else "train"
            hist = seq[max(0, t - max_items):t]
            out[split].append(([x for a in hist for x in toks(a)], toks(seq[t]) + [EOS]))
    return out


class CachedSplits:
    def __init__(self, raw_dir, sem_path, K, max_items, show_progress=False):
        with open(sem_path) as f:
            sem = {k: tuple(v) for k, v in json.load(f).items()}
        self.n_levels = len(next(iter(sem.values())))
        key = hashlib.md5(f"{sem_path}:{K}:{max_items}".encode()).hexdigest()[:10]
        cache = os.path.join(raw_dir, f"processed_{key}.pt")
        if os.path.exists(cache):
            self.splits = torch.load(cache)
        else:
            self.splits = preprocess(raw_dir, sem, K, max_items, show_progress)
            torch.save(self.splits, cache)


class ListDataset(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(batch, max_len=256):
    srcs = [s[-max_len:] for s, _ in batch]
    L = max(len(s) for s in srcs)
    ids = torch.zeros(len(batch), L, dtype=torch.long)
    for i, s in enumerate(srcs):
        ids[i, :len(s)] = torch.tensor(s)
    return ids, (ids != PAD).long(), torch.tensor([t for _, t in batch])


@torch.no_grad()
def recall(model, loader, device, n_levels, beams=20):
    model.eval()
    tot = torch.zeros(3, device=device)
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        gen = model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, num_return_sequences=beams,
                             max_new_tokens=n_levels + 1)
        gen = gen[:, 1:n_levels + 1].reshape(ids.size(0), beams, n_levels)
        hit = (gen == labels[:, None, :n_levels]).all(-1)
        tot += torch.stack([hit[:, :10].any(-1).sum().float(), hit.any(-1).sum().float(),
                            torch.tensor(float(ids.size(0)), device=device)])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--sem", required=True)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--max_items", type=int, default=20)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--out", default="ckpt/books_tiger")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    data = CachedSplits(args.raw, args.sem, args.K, args.max_items, show_progress=(rank == 0))
    n_levels = data.n_levels
    train_ds = ListDataset(data.splits["train"])
    valid_ds = ListDataset(data.splits["valid"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), batch_size=128,
                          collate_fn=collate, num_workers=2)

    cfg = T5Config(vocab_size=2 + n_levels * args.K, d_model=256, d_ff=2048, d_kv=64, num_layers=6,
                   num_heads=8, dropout_rate=0.1, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    net = T5ForConditionalGeneration(cfg).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, 1000, args.epochs * len(train_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} valid {len(valid_ds)} steps/epoch {len(train_dl)}")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        run = torch.zeros(2, device=device)
        for ids, mask, labels in train_dl:
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(run)
        r10, r20 = recall(net, valid_dl, device, n_levels)
        if rank == 0:
            print(f"== epoch {epoch} train_loss {(run[0] / run[1]).item():.4f} R@10 {r10:.4f} R@20 {r20:.4f}")
            if r10 > best:
                best = r10
                net.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
