"""TyDi QA GoldP (secondary task) with mBERT / XLM-R, DDP, early stopping on dev F1.

    torchrun --nproc_per_node=4 13_qa_tydi_goldp_patience.py --model bert-base-multilingual-cased \
        --output_dir runs/tydi-goldp-mbert --epochs 10 --patience 2
"""
import argparse
import collections
import logging
import os
import re
import string
import sys
import unicodedata

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

logger = logging.getLogger("tydi")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-base-multilingual-cased")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--patience", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--max_len", type=int, default=384)
    p.add_argument("--stride", type=int, default=128)
    p.add_argument("--n_best", type=int, default=20)
    p.add_argument("--max_answer_len", type=int, default=30)
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


def train_feats(ex, tok, a):
    enc = tok([q.strip() for q in ex["question"]], ex["context"], truncation="only_second", max_length=a.max_len,
              stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["start_positions"], enc["end_positions"] = [], []
    for i, offs in enumerate(enc.pop("offset_mapping")):
        seq = enc.sequence_ids(i)
        ans = ex["answers"][smap[i]]
        sc = ans["answer_start"][0]
        ec = sc + len(ans["text"][0])
        ctx = [k for k, s in enumerate(seq) if s == 1]
        if offs[ctx[0]][0] > sc or offs[ctx[-1]][1] < ec:
            enc["start_positions"].append(0)
            enc["end_positions"].append(0)
            continue
        enc["start_positions"].append(next(k for k in ctx if offs[k][1] > sc))
        enc["end_positions"].append(next(k for k in reversed(ctx) if offs[k][0] < ec))
    return enc


def eval_feats(ex, tok, a):
    enc = tok([q.strip() for q in ex["question"]], ex["context"], truncation="only_second", max_length=a.max_len,
              stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [ex["id"][j] for j in smap]
    enc["offset_mapping"] = [[o if s == 1 else None for o, s in zip(offs, enc.sequence_ids(i))]
                             for i, offs in enumerate(enc["offset_mapping"])]
    return enc


# --- TyDi / MLQA style multilingual normalisation ------------------------------------------------
PUNCT = {chr(i) for i in range(sys.maxunicode) if unicodedata.category(chr(i)).startswith("P")} | set(string.punctuation)


def normalize(text):
    text = "".join(ch for ch in text.lower() if ch not in PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(pred, gold):
    p, g = normalize(pred).split(), normalize(gold).split()
    common = sum((collections.Counter(p) & collections.Counter(g)).values())
    if common == 0:
        return 0.0
    return 2 * common / (len(p) + len(g))


def score(examples, feats, logits, a):
    groups = collections.defaultdict(list)
    for i, eid in enumerate(feats["example_id"]):
        groups[eid].append(i)
    em_sum = f1_sum = 0.0
    for ex in examples:
        best, best_score = "", -np.inf
        for fi in groups[ex["id"]]:
            st, en = logits[fi]
            offs = feats[fi]["offset_mapping"]
            for s in np.argsort(st)[::-1][: a.n_best]:
                for e in np.argsort(en)[::-1][: a.n_best]:
                    if s < len(offs) and e < len(offs) and offs[s] and offs[e] and s <= e < s + a.max_answer_len:
                        if st[s] + en[e] > best_score:
                            best_score, best = st[s] + en[e], ex["context"][offs[s][0]:offs[e][1]]
        golds = ex["answers"]["text"]
        em_sum += max(float(normalize(best) == normalize(g)) for g in golds)
        f1_sum += max(f1(best, g) for g in golds)
    return 100 * em_sum / len(examples), 100 * f1_sum / len(examples)


@torch.no_grad()
def evaluate(model, loader, device, rank):
    model.eval()
    rows = []
    for batch in loader:
        fidx = batch.pop("fidx").tolist()
        lens = batch["attention_mask"].sum(1).tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        st, en = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
        rows.extend((i, st[j, :lens[j]], en[j, :lens[j]]) for j, i in enumerate(fidx))
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    model.train()
    if rank != 0:
        return None
    return {i: (s, e) for part in gathered for i, s, e in part}


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(a.seed)

    tok = AutoTokenizer.from_pretrained(a.model)
    raw = load_dataset("tydiqa", "secondary_task")
    if rank != 0:
        dist.barrier()
    train = raw["train"].map(train_feats, batched=True, fn_kwargs={"tok": tok, "a": a},
                             remove_columns=raw["train"].column_names, num_proc=8)
    dev_feats = raw["validation"].map(eval_feats, batched=True, fn_kwargs={"tok": tok, "a": a},
                                      remove_columns=raw["validation"].column_names, num_proc=8)
    if rank == 0:
        dist.barrier()
    dev = dev_feats.remove_columns(["example_id", "offset_mapping"])
    dev = dev.add_column("fidx", list(range(len(dev))))

    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    sampler = DistributedSampler(train, shuffle=True, seed=a.seed)
    train_dl = DataLoader(train, batch_size=a.batch_size, sampler=sampler, collate_fn=collator,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev, batch_size=64, sampler=DistributedSampler(dev, shuffle=False), collate_fn=collator)

    model = AutoModelForQuestionAnswering.from_pretrained(a.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    total = a.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(a.warmup * total), total)

    best_f1, bad_epochs = -1.0, 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        logits = evaluate(model, dev_dl, device, rank)
        if rank == 0:
            em, f1_score = score(raw["validation"], dev_feats, logits, a)
            logger.info("epoch %d dev EM %.2f F1 %.2f", epoch, em, f1_score)
            if f1_score > best_f1:
                best_f1, bad_epochs = f1_score, 0
                model.module.save_pretrained(os.path.join(a.output_dir, "best"))
                tok.save_pretrained(os.path.join(a.output_dir, "best"))
            else:
                bad_epochs += 1
                if bad_epochs >= a.patience:
                    logger.info("no improvement for %d epochs, stopping (best F1 %.2f)", bad_epochs, best_f1)
                    break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
