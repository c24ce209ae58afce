"""Iterative back-translation for En<->De with two OPUS-MT models.

Each round:
  1. de->en model back-translates German monolingual text (sampling) -> synthetic en-de pairs
  2. en->de model is trained on real + synthetic pairs
  3. en->de model back-translates English monolingual text -> synthetic de-en pairs
  4. de->en model is trained on real + synthetic pairs

torchrun --standalone --nproc_per_node=8 09_iterative_backtranslation.py --work bt_work --rounds 3
"""
import argparse
import glob
import os
import random

import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, get_constant_schedule_with_warmup

P = argparse.ArgumentParser()
P.add_argument("--fwd-model", default="Helsinki-NLP/opus-mt-en-de")
P.add_argument("--bwd-model", default="Helsinki-NLP/opus-mt-de-en")
P.add_argument("--bitext", default="data/bitext/train")          # .en / .de
P.add_argument("--dev", default="data/newstest2019")              # .en / .de
P.add_argument("--mono-en", default="data/mono/news.2021.en.sample2M")
P.add_argument("--mono-de", default="data/mono/news.2021.de.sample2M")
P.add_argument("--work", default="bt_work")
P.add_argument("--rounds", type=int, default=3)
P.add_argument("--steps-per-round", type=int, default=20000)
P.add_argument("--bsz", type=int, default=32)
P.add_argument("--gen-bsz", type=int, default=128)
P.add_argument("--lr", type=float, default=3e-5)
P.add_argument("--max-len", type=int, default=200)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [l.rstrip("\n") for l in f]


def rank0_print(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


@torch.no_grad()
def translate_shard(model, tok, sentences, out_path, device, bsz, max_len, seed):
    """Translate this rank's slice of `sentences` and write `src\\thyp` lines to out_path."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    torch.manual_seed(seed + rank)
    mine = sentences[rank::world]
    with open(out_path, "w", encoding="utf-8") as f:
        for b in range(0, len(mine), bsz):
            chunk = mine[b : b + bsz]
            enc = tok(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_len).to(device)
            out = model.generate(**enc, do_sample=True, top_k=10, max_new_tokens=max_len)
            for s, h in zip(chunk, tok.batch_decode(out, skip_special_tokens=True)):
                h = " ".join(h.split())
                if h:
                    f.write(f"{s.replace(chr(9), ' ')}\t{h}\n")
    model.train()


def merge_parts(part_glob, merged_path):
    with open(merged_path, "w", encoding="utf-8") as out:
        for p in sorted(glob.glob(part_glob)):
            with open(p, encoding="utf-8") as f:
                out.writelines(f)


def make_loader(tok, src, tgt, bsz, max_len, seed):
    pairs = list(zip(src, tgt))

    def collate(batch):
        enc = tok([s for s, _ in batch], text_target=[t for _, t in batch], max_length=max_len,
                  truncation=True, padding=True, return_tensors="pt")
        enc["labels"][enc["labels"] == tok.pad_token_id] = -100
        return enc

    sampler = DistributedSampler(pairs, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(pairs, batch_size=bsz, sampler=sampler, collate_fn=collate, num_workers=2), sampler


def train_direction(ddp_model, loader, sampler, steps, lr, device, tag):
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=lr)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=500)
    ddp_model.train()
    step, epoch = 0, 0
    running = torch.zeros(2, device=device)
    while step < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp_model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            step += 1
            if step % 500 == 0:
                dist.all_reduce(running)
                rank0_print(f"[{tag}] step {step}/{steps} loss {(running[0] / running[1]).item():.4f}")
                running.zero_()
            if step >= steps:
                break
        epoch += 1


@torch.no_grad()
def dev_bleu(model, tok, src, ref, device, max_len):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    idx = list(range(rank, len(src), world))
    local = []
    for b in range(0, len(idx), 64):
        ids = idx[b : b + 64]
        enc = tok([src[i] for i in ids], return_tensors="pt", padding=True, truncation=True,
                  max_length=max_len).to(device)
        out = model.generate(**enc, num_beams=4, max_new_tokens=max_len)
        local.extend(zip(ids, tok.batch_decode(out, skip_special_tokens=True)))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    hyp = dict(x for p in parts for x in p)
    return sacrebleu.corpus_bleu([hyp[i] for i in range(len(src))], [ref]).score


def main():
    args = P.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok_f = AutoTokenizer.from_pretrained(args.fwd_model)
    tok_b = AutoTokenizer.from_pretrained(args.bwd_model)
    fwd = DDP(AutoModelForSeq2SeqLM.from_pretrained(args.fwd_model).to(device), device_ids=[local_rank])
    bwd = DDP(AutoModelForSeq2SeqLM.from_pretrained(args.bwd_model).to(device), device_ids=[local_rank])

    bi_en, bi_de = read_lines(args.bitext + ".en"), read_lines(args.bitext + ".de")
    dev_en, dev_de = read_lines(args.dev + ".en"), read_lines(args.dev + ".de")
    mono_en, mono_de = read_lines(args.mono_en), read_lines(args.mono_de)
    if rank == 0:
        os.makedirs(args.work, exist_ok=True)
    dist.barrier()

    rank0_print(f"round 0: en-de {dev_bleu(fwd.module, tok_f, dev_en, dev_de, device, args.max_len):.2f} "
                f"de-en {dev_bleu(bwd.module, tok_b, dev_de, dev_en, device, args.max_len):.2f}")

    for r in range(1, args.rounds + 1):
        rdir = os.path.join(args.work, f"round{r}")
        if rank == 0:
            os.makedirs(rdir, exist_ok=True)
        dist.barrier()

        # 1-2: de->en back-translation, train en->de
        translate_shard(bwd.module, tok_b, mono_de, os.path.join(rdir, f"bt_de.part{rank:02d}"),
                        device, args.gen_bsz, args.max_len, seed=1000 * r)
        dist.barrier()
        if rank == 0:
            merge_parts(os.path.join(rdir, "bt_de.part*"), os.path.join(rdir, "bt_de.tsv"))
        dist.barrier()
        syn = [l.split("\t", 1) for l in read_lines(os.path.join(rdir, "bt_de.tsv"))]
        src = bi_en + [h for _, h in syn]
        tgt = bi_de + [s for s, _ in syn]
        loader, sampler = make_loader(tok_f, src, tgt, args.bsz, args.max_len, seed=r)
        train_direction(fwd, loader, sampler, args.steps_per_round, args.lr, device, f"r{r} en-de")

        # 3-4: en->de back-translation, train de->en
        translate_shard(fwd.module, tok_f, mono_en, os.path.join(rdir, f"bt_en.part{rank:02d}"),
                        device, args.gen_bsz, args.max_len, seed=2000 * r)
        dist.barrier()
        if rank == 0:
            merge_parts(os.path.join(rdir, "bt_en.part*"), os.path.join(rdir, "bt_en.tsv"))
        dist.barrier()
        syn = [l.split("\t", 1) for l in read_lines(os.path.join(rdir, "bt_en.tsv"))]
        src = bi_de + [h for _, h in syn]
        tgt = bi_en + [s for s, _ in syn]
        loader, sampler = make_loader(tok_b, src, tgt, args.bsz, args.max_len, seed=r + 100)
        train_direction(bwd, loader, sampler, args.steps_per_round, args.lr, device, f"r{r} de-en")

        b_f = dev_bleu(fwd.module, tok_f, dev_en, dev_de, device, args.max_len)
        b_b = dev_bleu(bwd.module, tok_b, dev_de, dev_en, device, args.max_len)
        rank0_print(f"round {r}: en-de {b_f:.2f} de-en {b_b:.2f}")
        if rank == 0:
            fwd.module.save_pretrained(os.path.join(rdir, "en-de"))
            tok_f.save_pretrained(os.path.join(rdir, "en-de"))
            bwd.module.save_pretrained(os.path.join(rdir, "de-en"))
            tok_b.save_pretrained(os.path.join(rdir, "de-en"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
