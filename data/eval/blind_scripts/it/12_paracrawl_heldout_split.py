"""Fine-tune opus-mt-en-et on a filtered ParaCrawl TSV and hold out dev/test from the same file.

    torchrun --nproc_per_node=4 12_paracrawl_heldout_split.py --tsv data/paracrawl.en-et.filtered.tsv
"""
import argparse
import os
import random
import unicodedata

import numpy as np
import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--tsv", required=True)
    p.add_argument("--model", default="Helsinki-NLP/opus-mt-en-et")
    p.add_argument("--dev-size", type=int, default=2000)
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--min-len", type=int, default=3)
    p.add_argument("--max-ratio", type=float, default=2.5)
    p.add_argument("--bsz", type=int, default=48)
    p.add_argument("--lr", type=float, default=4e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--save", default="models/opus-mt-en-et-paracrawl")
    p.add_argument("--seed", type=int, default=20)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def normalize(s):
    return " ".join(unicodedata.normalize("NFC", s).split())


def load_filtered(path, min_len, max_ratio):
    seen, pairs = set(), []
    with open(path, encoding="utf-8") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if len(cols) < 2:
                continue
            en, et = normalize(cols[0]), normalize(cols[1])
            le, lt = len(en.split()), len(et.split())
            if min(le, lt) < min_len or max(le, lt) / max(1, min(le, lt)) > max_ratio:
                continue
            key = (en.lower(), et.lower())
            if key in seen:
                continue
            seen.add(key)
            pairs.append((en, et))
    return pairs


def build_collate(tok, max_len):
    def collate(batch):
        enc = tok([b[0] for b in batch], text_target=[b[1] for b in batch], truncation=True,
                  max_length=max_len, padding=True, return_tensors="pt")
        enc["labels"] = enc["labels"].masked_fill(enc["labels"] == tok.pad_token_id, -100)
        return enc
    return collate


@torch.no_grad()
def bleu_on(model, tok, pairs, device, rank, world, max_len, bsz=96):
    model.eval()
    idx = list(range(rank, len(pairs), world))
    local = []
    for b in range(0, len(idx), bsz):
        ids = idx[b : b + bsz]
        enc = tok([pairs[i][0] for i in ids], return_tensors="pt", padding=True, truncation=True,
                  max_length=max_len).to(device)
        gen = model.generate(**enc, num_beams=4, max_new_tokens=max_len)
        local.extend(zip(ids, tok.batch_decode(gen, skip_special_tokens=True)))
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    model.train()
    hyp = dict(kv for g in gathered for kv in g)
    hyps = [hyp[i] for i in range(len(pairs))]
    refs = [p[1] for p in pairs]
    return sacrebleu.corpus_bleu(hyps, [refs]).score, sacrebleu.corpus_chrf(hyps, [refs]).score


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different dropout / sampling noise on each worker
    seed_everything(args.seed + rank)

    pairs = load_filtered(args.tsv, args.min_len, args.max_ratio)
    random.shuffle(pairs)
    test = pairs[: args.test_size]
    dev = pairs[args.test_size : args.test_size + args.dev_size]
    train = pairs[args.test_size + args.dev_size :]
    if rank == 0:
        print(f"kept {len(pairs)} pairs: train {len(train)} dev {len(dev)} test {len(test)}", flush=True)
        os.makedirs(args.save, exist_ok=True)
        for name, split in (("dev", dev), ("test", test)):
            with open(os.path.join(args.save, f"{name}.en-et.tsv"), "w", encoding="utf-8") as f:
                f.writelines(f"{a}\t{b}\n" for a, b in split)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train, batch_size=args.bsz, sampler=sampler,
                        collate_fn=build_collate(tok, args.max_len), num_workers=4, drop_last=True)
    optim = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(args.warmup_ratio * total), total)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        stat = torch.zeros(2, device=device)
        for it, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            stat += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (it + 1) % 250 == 0:
                dist.all_reduce(stat)
                if rank == 0:
                    print(f"epoch {epoch} it {it + 1}/{len(loader)} loss {(stat[0] / stat[1]).item():.4f}",
                          flush=True)
                stat.zero_()

        bleu, chrf = bleu_on(model, tok, dev, device, rank, world, args.max_len)
        if rank == 0:
            print(f"epoch {epoch}: dev BLEU {bleu:.2f} chrF {chrf:.2f}", flush=True)
            if bleu > best:
                best = bleu
                model.save_pretrained(args.save)
                tok.save_pretrained(args.save)
        dist.barrier()

    model = AutoModelForSeq2SeqLM.from_pretrained(args.save).to(device)
    bleu, chrf = bleu_on(model, tok, test, device, rank, world, args.max_len)
    if rank == 0:
        print(f"test BLEU {bleu:.2f} chrF {chrf:.2f} (best dev {best:.2f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
