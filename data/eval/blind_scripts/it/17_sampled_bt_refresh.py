"""Sampled back-translation with a synthetic corpus that is regenerated every round.

A fixed reverse model (is->en) samples English sources for Icelandic monolingual news;
the forward model (en->is) is then trained on bitext + that round's synthetic data,
with the synthetic side marked by a <BT> tag on the source.

torchrun --nproc_per_node=8 17_sampled_bt_refresh.py --work work/bt_enis
"""
import argparse
import logging
import os

import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("bt")
BT_TAG = "<BT>"


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fwd", default="Helsinki-NLP/opus-mt-en-is")
    ap.add_argument("--rev", default="Helsinki-NLP/opus-mt-is-en")
    ap.add_argument("--bitext", default="data/en-is/bitext")
    ap.add_argument("--mono", default="data/is/news.is.1M")
    ap.add_argument("--dev", default="data/en-is/wmt21.dev")
    ap.add_argument("--work", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs-per-round", type=int, default=1)
    ap.add_argument("--bsz", type=int, default=32)
    ap.add_argument("--gen-bsz", type=int, default=96)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--max-len", type=int, default=200)
    return ap.parse_args()


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [x.rstrip("\n") for x in f]


class ListDataset(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@torch.no_grad()
def back_translate(rev_model, rev_tok, mono, out_file, device, args, rnd):
    torch.manual_seed(1000 * rnd + dist.get_rank())
    rev_model.eval()
    loader = DataLoader(ListDataset(mono), batch_size=args.gen_bsz, collate_fn=list, num_workers=2)
    n = 0
    with open(out_file, "w", encoding="utf-8") as f:
        for batch in loader:
            enc = rev_tok(batch, return_tensors="pt", padding=True, truncation=True,
                          max_length=args.max_len).to(device)
            gen = rev_model.generate(**enc, do_sample=True, top_p=0.9, max_new_tokens=args.max_len)
            for tgt, src in zip(batch, rev_tok.batch_decode(gen, skip_special_tokens=True)):
                src = " ".join(src.split())
                if src:
                    f.write(f"{src}\t{tgt}\n")
                    n += 1
    return n


def make_train_loader(tok, pairs, args, epoch_seed):
    def collate(batch):
        enc = tok([s for s, _ in batch], text_target=[t for _, t in batch], truncation=True,
                  max_length=args.max_len, padding=True, return_tensors="pt")
        enc["labels"][enc["labels"] == tok.pad_token_id] = -100
        return enc
    ds = ListDataset(pairs)
    sampler = DistributedSampler(ds, shuffle=True, seed=epoch_seed, drop_last=True)
    return DataLoader(ds, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=4,
                      drop_last=True), sampler


@torch.no_grad()
def dev_bleu(model, tok, src, ref, device, args):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    mine = list(range(rank, len(src), world))
    local = []
    for b in range(0, len(mine), 64):
        ids = mine[b : b + 64]
        enc = tok([src[i] for i in ids], return_tensors="pt", padding=True, truncation=True,
                  max_length=args.max_len).to(device)
        local += zip(ids, tok.batch_decode(model.generate(**enc, num_beams=5, max_new_tokens=args.max_len),
                                           skip_special_tokens=True))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    hyp = dict(x for p in parts for x in p)
    return sacrebleu.corpus_bleu([hyp[i] for i in range(len(src))], [ref]).score


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    if rank == 0:
        os.makedirs(args.work, exist_ok=True)
    dist.barrier()

    fwd_tok = AutoTokenizer.from_pretrained(args.fwd)
    fwd_tok.add_tokens([BT_TAG], special_tokens=True)
    fwd_model = AutoModelForSeq2SeqLM.from_pretrained(args.fwd)
    fwd_model.resize_token_embeddings(len(fwd_tok))
    fwd_model.to(device)
    fwd = DDP(fwd_model, device_ids=[local_rank])
    rev_tok = AutoTokenizer.from_pretrained(args.rev)
    rev_model = AutoModelForSeq2SeqLM.from_pretrained(args.rev).to(device)

    bitext = list(zip(lines(args.bitext + ".en"), lines(args.bitext + ".is")))
    mono = lines(args.mono)
    dev_src, dev_ref = lines(args.dev + ".en"), lines(args.dev + ".is")
    log.info("bitext %d, mono %d, world %d", len(bitext), len(mono), world)
    log.info("baseline dev BLEU %.2f", dev_bleu(fwd_model, fwd_tok, dev_src, dev_ref, device, args))

    for rnd in range(1, args.rounds + 1):
        part = os.path.join(args.work, f"bt.r{rnd}.part{rank}")
        n = back_translate(rev_model, rev_tok, mono, part, device, args, rnd)
        log.info("round %d: rank %d wrote %d synthetic pairs", rnd, rank, n)
        dist.barrier()
        synthetic = []
        for r in range(world):
            for l in lines(os.path.join(args.work, f"bt.r{rnd}.part{r}")):
                src, tgt = l.split("\t", 1)
                synthetic.append((f"{BT_TAG} {src}", tgt))
        pairs = bitext + synthetic
        log.info("round %d: training on %d bitext + %d synthetic", rnd, len(bitext), len(synthetic))

        loader, sampler = make_train_loader(fwd_tok, pairs, args, epoch_seed=rnd)
        opt = torch.optim.AdamW(fwd.parameters(), lr=args.lr, weight_decay=0.01)
        total = len(loader) * args.epochs_per_round
        sched = get_linear_schedule_with_warmup(opt, min(1000, total // 10), total)
        fwd.train()
        for ep in range(args.epochs_per_round):
            sampler.set_epoch(ep)
            acc = torch.zeros(2, device=device)
            for i, batch in enumerate(loader):
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = fwd(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(fwd.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
                if (i + 1) % 500 == 0:
                    dist.all_reduce(acc)
                    log.info("round %d ep %d it %d/%d loss %.4f", rnd, ep, i + 1, len(loader),
                             (acc[0] / acc[1]).item())
                    acc.zero_()

        bleu = dev_bleu(fwd_model, fwd_tok, dev_src, dev_ref, device, args)
        log.info("round %d dev BLEU %.2f", rnd, bleu)
        if rank == 0:
            out = os.path.join(args.work, f"en-is.round{rnd}")
            fwd_model.save_pretrained(out)
            fwd_tok.save_pretrained(out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
