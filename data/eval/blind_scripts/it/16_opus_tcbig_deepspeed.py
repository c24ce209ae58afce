"""Continue training opus-mt-tc-big-en-uk on news + subtitles with DeepSpeed ZeRO-2.

Batches are "sortish": each global batch holds sentences of similar length and is split
evenly across ranks, so padding stays low and all ranks run the same number of steps.

deepspeed --num_gpus 4 16_opus_tcbig_deepspeed.py --data data/en-uk --out ckpt/tcbig-en-uk
"""
import argparse
import math
import os
import random

import deepspeed
import sacrebleu
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

DS_CONFIG = {
    "train_batch_size": 512,
    "train_micro_batch_size_per_gpu": 32,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.98], "eps": 1e-9,
                                              "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                                  "warmup_num_steps": 2000, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "allgather_bucket_size": 2e8, "reduce_bucket_size": 2e8},
    "steps_per_print": 500,
}


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Helsinki-NLP/opus-mt-tc-big-en-uk")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


class Bitext(Dataset):
    def __init__(self, prefix, tok, max_len):
        with open(prefix + ".en", encoding="utf-8") as f:
            self.src = [l.strip() for l in f]
        with open(prefix + ".uk", encoding="utf-8") as f:
            self.tgt = [l.strip() for l in f]
        self.tok, self.max_len = tok, max_len
        self.lengths = [len(s.split()) for s in self.src]

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.src[i], self.tgt[i]


class SortishDistributedSampler(Sampler):
    def __init__(self, lengths, micro_bsz, rank, world, seed=0, chunk=64):
        self.lengths, self.bsz, self.rank, self.world = lengths, micro_bsz, rank, world
        self.seed, self.chunk, self.epoch = seed, chunk, 0
        self.global_bsz = micro_bsz * world
        self.num_batches = len(lengths) // self.global_bsz

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = random.Random(self.seed + self.epoch)          # same permutation on every rank
        idx = list(range(len(self.lengths)))
        g.shuffle(idx)
        idx = idx[: self.num_batches * self.global_bsz]
        span = self.global_bsz * self.chunk
        batches = []
        for s in range(0, len(idx), span):
            block = sorted(idx[s : s + span], key=lambda i: self.lengths[i])
            batches += [block[b : b + self.global_bsz] for b in range(0, len(block), self.global_bsz)]
        g.shuffle(batches)
        for gb in batches:
            yield from gb[self.rank * self.bsz : (self.rank + 1) * self.bsz]

    def __len__(self):
        return self.num_batches * self.bsz


def collate_fn(tok, max_len):
    def collate(batch):
        enc = tok([s for s, _ in batch], text_target=[t for _, t in batch], max_length=max_len,
                  truncation=True, padding=True, return_tensors="pt")
        enc["labels"][enc["labels"] == tok.pad_token_id] = -100
        return enc
    return collate


@torch.no_grad()
def flores_dev(engine, tok, src, ref, rank, world, max_len):
    engine.eval()
    mine = list(range(rank, len(src), world))
    local = []
    for b in range(0, len(mine), 64):
        ids = mine[b : b + 64]
        enc = tok([src[i] for i in ids], return_tensors="pt", padding=True, truncation=True,
                  max_length=max_len).to(engine.device)
        out = engine.module.generate(**enc, num_beams=4, max_new_tokens=max_len)
        local += list(zip(ids, tok.batch_decode(out, skip_special_tokens=True)))
    allp = [None] * world
    dist.all_gather_object(allp, local)
    engine.train()
    h = dict(x for p in allp for x in p)
    hyps = [h[i] for i in range(len(src))]
    return sacrebleu.corpus_bleu(hyps, [ref]).score, sacrebleu.corpus_chrf(hyps, [ref]).score


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
    train = Bitext(os.path.join(args.data, "train"), tok, args.max_len)
    with open(os.path.join(args.data, "flores200.dev.en"), encoding="utf-8") as f:
        dev_src = [l.strip() for l in f]
    with open(os.path.join(args.data, "flores200.dev.uk"), encoding="utf-8") as f:
        dev_ref = [l.strip() for l in f]

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    micro = engine.train_micro_batch_size_per_gpu()
    sampler = SortishDistributedSampler(train.lengths, micro, rank, world, seed=17)
    loader = DataLoader(train, batch_size=micro, sampler=sampler, collate_fn=collate_fn(tok, args.max_len),
                        num_workers=4, pin_memory=True, drop_last=True)

    best = -math.inf
    micro_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            micro_step += 1
            if micro_step % engine.gradient_accumulation_steps() == 0:
                upd = engine.global_steps
                if upd % args.eval_every == 0:
                    bleu, chrf = flores_dev(engine, tok, dev_src, dev_ref, rank, world, args.max_len)
                    if rank == 0:
                        print(f"epoch {epoch} update {upd}: FLORES dev BLEU {bleu:.2f} chrF {chrf:.2f}",
                              flush=True)
                    engine.save_checkpoint(args.out, tag=f"upd{upd}", client_state={"bleu": bleu})
                    if bleu > best:
                        best = bleu
                        if rank == 0:
                            engine.module.save_pretrained(os.path.join(args.out, "best_hf"))
                            tok.save_pretrained(os.path.join(args.out, "best_hf"))
                    dist.barrier()

    engine.save_checkpoint(args.out, tag="last")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
