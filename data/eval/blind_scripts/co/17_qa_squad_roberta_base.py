#!/usr/bin/env python
"""
roberta-base on SQuAD v1.1, small hand-rolled trainer class around DDP.

    torchrun --nproc_per_node=4 17_qa_squad_roberta_base.py --epochs 3 --out runs/rb-squad
"""
import argparse
import collections
import logging
import os
from dataclasses import dataclass

import evaluate
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

log = logging.getLogger("rb-squad")


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def device(self):
        return torch.device("cuda", self.local_rank)


def init_distributed() -> DistEnv:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return DistEnv(dist.get_rank(), local_rank, dist.get_world_size())


def features_for_training(batch, tok, max_len, stride):
    enc = tok([q.lstrip() for q in batch["question"]], batch["context"], max_length=max_len, stride=stride,
              truncation="only_second", return_overflowing_tokens=True, return_offsets_mapping=True)
    sample_idx = enc.pop("overflow_to_sample_mapping")
    starts, ends = [], []
    for i, offsets in enumerate(enc.pop("offset_mapping")):
        seq = enc.sequence_ids(i)
        ans = batch["answers"][sample_idx[i]]
        a0 = ans["answer_start"][0]
        a1 = a0 + len(ans["text"][0])
        ctx = [k for k, s in enumerate(seq) if s == 1]
        if offsets[ctx[0]][0] > a0 or offsets[ctx[-1]][1] < a1:
            starts.append(0)
            ends.append(0)
        else:
            starts.append(next(k for k in ctx if offsets[k][1] > a0))
            ends.append(next(k for k in reversed(ctx) if offsets[k][0] < a1))
    enc["start_positions"] = starts
    enc["end_positions"] = ends
    return enc


def features_for_eval(batch, tok, max_len, stride):
    enc = tok([q.lstrip() for q in batch["question"]], batch["context"], max_length=max_len, stride=stride,
              truncation="only_second", return_overflowing_tokens=True, return_offsets_mapping=True)
    sample_idx = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [batch["id"][j] for j in sample_idx]
    enc["offset_mapping"] = [[o if s == 1 else None for o, s in zip(offs, enc.sequence_ids(i))]
                             for i, offs in enumerate(enc["offset_mapping"])]
    return enc


class QATrainer:
    def __init__(self, args, env: DistEnv, model, tokenizer, train_ds, eval_examples, eval_features):
        self.args, self.env, self.tok = args, env, tokenizer
        self.eval_examples, self.eval_features = eval_examples, eval_features
        collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

        self.train_sampler = DistributedSampler(train_ds, num_replicas=env.world_size, rank=env.rank,
                                                shuffle=True, seed=args.seed)
        self.train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=self.train_sampler,
                                       collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)
        eval_ds = eval_features.remove_columns(["example_id", "offset_mapping"])
        eval_ds = eval_ds.add_column("fid", list(range(len(eval_ds))))
        self.eval_loader = DataLoader(eval_ds, batch_size=64, collate_fn=collator,
                                      sampler=DistributedSampler(eval_ds, num_replicas=env.world_size,
                                                                 rank=env.rank, shuffle=False))

        self.model = DDP(model.to(env.device), device_ids=[env.local_rank])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        total = len(self.train_loader) * args.epochs
        self.scheduler = get_linear_schedule_with_warmup(self.optimizer, int(0.1 * total), total)
        self.metric = evaluate.load("squad")

    def train_epoch(self, epoch):
        self.model.train()
        for step, batch in enumerate(self.train_loader):
            batch = {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = self.model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(self.train_loader), loss.item())

    @torch.no_grad()
    def predict(self):
        self.model.eval()
        mine = []
        for batch in self.eval_loader:
            fid = batch.pop("fid").tolist()
            n = batch["attention_mask"].sum(1).tolist()
            batch = {k: v.to(self.env.device) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = self.model(**batch)
            s, e = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
            mine.extend((f, s[j, :n[j]], e[j, :n[j]]) for j, f in enumerate(fid))
        everything = [None] * self.env.world_size
        dist.all_gather_object(everything, mine)
        self.model.train()
        return {f: (s, e) for part in everything for f, s, e in part}

    def score(self, logits):
        by_example = collections.defaultdict(list)
        for i, eid in enumerate(self.eval_features["example_id"]):
            by_example[eid].append(i)
        preds, refs = [], []
        for ex in self.eval_examples:
            best, best_score = "", -np.inf
            for fi in by_example[ex["id"]]:
                st, en = logits[fi]
                offs = self.eval_features[fi]["offset_mapping"]
                for s in np.argsort(st)[::-1][: self.args.n_best]:
                    for e in np.argsort(en)[::-1][: self.args.n_best]:
                        if s >= len(offs) or e >= len(offs) or offs[s] is None or offs[e] is None:
                            continue
                        if e < s or e - s + 1 > self.args.max_answer_len:
                            continue
                        if st[s] + en[e] > best_score:
                            best_score, best = st[s] + en[e], ex["context"][offs[s][0]:offs[e][1]]
            preds.append({"id": ex["id"], "prediction_text": best})
            refs.append({"id": ex["id"], "answers": ex["answers"]})
        return self.metric.compute(predictions=preds, references=refs)

    def fit(self):
        best_f1 = 0.0
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            logits = self.predict()
            if self.env.is_main:
                res = self.score(logits)
                log.info("epoch %d: EM %.2f F1 %.2f", epoch, res["exact_match"], res["f1"])
                if res["f1"] > best_f1:
                    best_f1 = res["f1"]
                    self.model.module.save_pretrained(self.args.out)
                    self.tok.save_pretrained(self.args.out)
            dist.barrier()
        return best_f1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--max_len", type=int, default=384)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--n_best", type=int, default=20)
    ap.add_argument("--max_answer_len", type=int, default=30)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    env = init_distributed()
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    squad = load_dataset("squad")
    kw = {"tok": tok, "max_len": args.max_len, "stride": args.stride}
    if not env.is_main:
        dist.barrier()
    train_ds = squad["train"].map(features_for_training, batched=True, fn_kwargs=kw,
                                  remove_columns=squad["train"].column_names, num_proc=8)
    eval_features = squad["validation"].map(features_for_eval, batched=True, fn_kwargs=kw,
                                            remove_columns=squad["validation"].column_names, num_proc=8)
    if env.is_main:
        dist.barrier()

    model = AutoModelForQuestionAnswering.from_pretrained(args.model)
    trainer = QATrainer(args, env, model, tok, train_ds, squad["validation"], eval_features)
    best = trainer.fit()
    log.info("best dev F1 %.2f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
