#!/usr/bin/env python
"""Extend mBART-50 one-to-many with language codes it was not pre-trained on
(Luxembourgish, Faroese, Maltese), then fine-tune on en->{lb,fo,mt}.

    torchrun --nproc_per_node=8 15_mbart_extend_langs.py --data_dir data/ext3 --output_dir out/mbart50-ext3
"""
import argparse
import csv
import logging
import os

import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import (MBart50TokenizerFast, MBartForConditionalGeneration,
                          get_linear_schedule_with_warmup)

logger = logging.getLogger(__name__)

NEW_LANG_CODES = {"lb": "lb_LU", "fo": "fo_FO", "mt": "mt_MT"}
INIT_FROM = {"lb_LU": "de_DE", "fo_FO": "sv_SE", "mt_MT": "ar_AR"}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="facebook/mbart-large-50-one-to-many-mmt")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--warmup_steps", type=int, default=800)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--num_beams", type=int, default=4)
    return ap.parse_args()


class TsvBitext(Dataset):
    def __init__(self, path, lang_code):
        with open(path, encoding="utf-8", newline="") as f:
            self.rows = [(r[0], r[1]) for r in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if len(r) == 2]
        self.code = lang_code

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i][0], self.rows[i][1], self.code


def make_collate(tokenizer, max_length):
    def collate(batch):
        feats = []
        for src, tgt, code in batch:
            tokenizer.tgt_lang = code
            feats.append(tokenizer(src, text_target=tgt, max_length=max_length, truncation=True))
        padded = tokenizer.pad([{"input_ids": f["input_ids"], "attention_mask": f["attention_mask"]} for f in feats],
                               return_tensors="pt")
        labels = tokenizer.pad({"input_ids": [f["labels"] for f in feats]}, return_tensors="pt")["input_ids"]
        labels[labels == tokenizer.pad_token_id] = -100
        padded["labels"] = labels
        return padded
    return collate


@torch.no_grad()
def dev_scores(model, tokenizer, dev_sets, args, device, rank, world):
    model.eval()
    local = {}
    for code, ds in dev_sets.items():
        ids = list(range(rank, len(ds), world))
        out = []
        for b in range(0, len(ids), 32):
            chunk = ids[b : b + 32]
            enc = tokenizer([ds.rows[i][0] for i in chunk], return_tensors="pt", padding=True,
                            truncation=True, max_length=args.max_length).to(device)
            gen = model.generate(**enc, forced_bos_token_id=tokenizer.convert_tokens_to_ids(code),
                                 num_beams=args.num_beams, max_new_tokens=args.max_length)
            out.extend(zip(chunk, tokenizer.batch_decode(gen, skip_special_tokens=True)))
        local[code] = out
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    scores = {}
    for code, ds in dev_sets.items():
        hyp = dict(x for p in parts for x in p[code])
        hyps = [hyp[i] for i in range(len(ds))]
        scores[code] = sacrebleu.corpus_chrf(hyps, [[r[1] for r in ds.rows]], word_order=2).score
    return scores


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                        level=logging.INFO if is_main else logging.WARN)
    torch.manual_seed(13)

    tokenizer = MBart50TokenizerFast.from_pretrained(args.model_name, src_lang="en_XX")
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        added = [c for c in NEW_LANG_CODES.values() if c not in tokenizer.get_vocab()]
        tokenizer.add_special_tokens({"additional_special_tokens": added},
                                     replace_additional_special_tokens=False)
        tokenizer.save_pretrained(args.output_dir)
        logger.info("added language codes %s -> vocab %d", added, len(tokenizer))
    dist.barrier()

    model = MBartForConditionalGeneration.from_pretrained(args.model_name)
    model.resize_token_embeddings(len(tokenizer))
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        for new, old in INIT_FROM.items():
            emb[tokenizer.convert_tokens_to_ids(new)] = emb[tokenizer.convert_tokens_to_ids(old)]
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank])

    train = torch.utils.data.ConcatDataset(
        [TsvBitext(os.path.join(args.data_dir, f"train.en-{l}.tsv"), c) for l, c in NEW_LANG_CODES.items()])
    dev = {c: TsvBitext(os.path.join(args.data_dir, f"dev.en-{l}.tsv"), c) for l, c in NEW_LANG_CODES.items()}
    sampler = DistributedSampler(train, shuffle=True, seed=13, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        collate_fn=make_collate(tokenizer, args.max_length), drop_last=True)

    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, len(loader) * args.epochs)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for step, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (step + 1) % 200 == 0:
                dist.all_reduce(total)
                logger.info("epoch %d step %d loss %.4f", epoch, step + 1, (total[0] / total[1]).item())
                total.zero_()

        scores = dev_scores(model, tokenizer, dev, args, device, rank, world)
        avg = sum(scores.values()) / len(scores)
        logger.info("epoch %d dev chrF++ %s avg %.2f", epoch, {k: round(v, 2) for k, v in scores.items()}, avg)
        if is_main and avg > best:
            best = avg
            model.save_pretrained(os.path.join(args.output_dir, "best"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
