"""
Fine-tune a pretrained T5 on semantic-ID recommendation (LC-Rec / IDGenRec flavour).

Each item becomes four new vocabulary tokens <a_x><b_y><c_z><d_w> taken from the frozen
RQ-VAE (d = collision level). Decoding is constrained with a prefix trie so that only
existing items can be generated.

torchrun --standalone --nproc_per_node=8 20_lcrec_codes_finetune.py --data data/instruments --base t5-base
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, T5ForConditionalGeneration, get_linear_schedule_with_warmup

PREFIXES = "abcdefgh"


def item_string(codes):
    return "".join(f"<{PREFIXES[l]}_{int(c)}>" for l, c in enumerate(codes))


class PromptData(Dataset):
    def __init__(self, seqs, sem, split, max_items=20):
        self.sem, self.rows = sem, []
        for s in seqs:
            if split == "train":
                self.rows += [(s[max(0, t - max_items):t], s[t]) for t in range(1, len(s) - 2)]
            else:
                self.rows.append((s[-2 - max_items:-2], s[-2]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        h, t = self.rows[i]
        prompt = "The user has purchased: " + ", ".join(item_string(self.sem[x]) for x in h) + \
                 ". Recommend the next item:"
        return prompt, item_string(self.sem[t])


class Collate:
    def __init__(self, tok, max_len=512):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        src, tgt = zip(*batch)
        enc = self.tok(list(src), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        lab = self.tok(list(tgt), padding=True, return_tensors="pt").input_ids
        lab[lab == self.tok.pad_token_id] = -100
        return enc.input_ids, enc.attention_mask, lab


def build_trie(tok, sem):
    trie = {}
    for codes in sem:
        node = trie
        for t in tok(item_string(codes), add_special_tokens=False).input_ids + [tok.eos_token_id]:
            node = node.setdefault(t, {})
    return trie


def make_prefix_fn(trie, start_id):
    def fn(batch_id, sent):
        node = trie
        for t in sent.tolist():
            if t == start_id and node is trie:
                continue
            node = node.get(t, {})
        return list(node.keys()) or [0]
    return fn


@torch.no_grad()
def evaluate(net, loader, tok, prefix_fn, device, beams=20, n_levels=4):
    net.eval()
    s = torch.zeros(3, device=device)
    for ids, mask, lab in loader:
        ids, mask = ids.to(device), mask.to(device)
        out = net.generate(input_ids=ids, attention_mask=mask, num_beams=beams, num_return_sequences=beams,
                           max_new_tokens=n_levels + 1, prefix_allowed_tokens_fn=prefix_fn)
        preds = tok.batch_decode(out, skip_special_tokens=True)
        gold = tok.batch_decode(lab.clamp(min=0), skip_special_tokens=True)
        for b, g in enumerate(gold):
            cand = [p.replace(" ", "") for p in preds[b * beams:(b + 1) * beams]]
            g = g.replace(" ", "")
            s[0] += float(g in cand[:10])
            s[1] += float(g in cand)
        s[2] += len(gold)
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--base", default="t5-base")
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default="ckpt/lcrec_instruments")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    sem = np.load(os.path.join(args.data, "sem_ids.npy"))
    n_levels = sem.shape[1]
    with open(os.path.join(args.data, "seqs.json")) as f:
        seqs = json.load(f)

    tok = AutoTokenizer.from_pretrained(args.base)
    new_tokens = [f"<{PREFIXES[l]}_{c}>" for l in range(n_levels) for c in range(args.K)]
    tok.add_tokens(new_tokens)
    model = T5ForConditionalGeneration.from_pretrained(args.base)
    model.resize_token_embeddings(len(tok))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train, valid = PromptData(seqs, sem, "train"), PromptData(seqs, sem, "valid")
    coll = Collate(tok)
    sampler = DistributedSampler(train, shuffle=True)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=coll, num_workers=4, drop_last=True)
    valid_dl = DataLoader(Subset(valid, range(rank, len(valid), world)), batch_size=16, collate_fn=coll)
    prefix_fn = make_prefix_fn(build_trie(tok, sem), model.module.config.decoder_start_token_id)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(0.02 * total), total)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for ids, mask, lab in train_dl:
            ids, mask, lab = ids.to(device), mask.to(device), lab.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
            if not torch.isfinite(loss):
                stats[2] += 1
                opt.zero_grad(set_to_none=True)
                continue
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            stats[0] += loss.detach().float()
            stats[1] += 1
        dist.all_reduce(stats)
        r10, r20 = evaluate(model.module, valid_dl, tok, prefix_fn, device, n_levels=n_levels)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1].clamp(min=1)).item():.4f} skipped {int(stats[2])} "
                  f"recall@10 {r10:.4f} recall@20 {r20:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if r10 > best:
                best = r10
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
