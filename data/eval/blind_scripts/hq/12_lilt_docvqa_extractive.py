"""Extractive QA over OCR'd pages with LiLT (text + layout, no pixels).

Input: jsonl with {"question", "answers", "words", "boxes" (0-1000), "ans_word_start", "ans_word_end"}.

    torchrun --nproc_per_node=8 12_lilt_docvqa_extractive.py --train_file data/train.jsonl --val_file data/val.jsonl
"""
import argparse
import json
import logging
import os

import editdistance
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, LiltForQuestionAnswering, get_linear_schedule_with_warmup

logger = logging.getLogger("lilt_qa")
PAD_BOX = [0, 0, 0, 0]
SEP_BOX = [1000, 1000, 1000, 1000]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--val_file", required=True)
    ap.add_argument("--model", default="SCUT-DLVCLab/lilt-roberta-en-base")
    ap.add_argument("--output_dir", default="models/lilt_docvqa")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


class QADataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        enc = self.tok(r["question"].split(), r["words"], is_split_into_words=True,
                       truncation="only_second", max_length=self.max_len, padding="max_length")
        wids, sids = enc.word_ids(), enc.sequence_ids()
        boxes, ctx_words = [], []
        start = end = 0
        for t, (w, s) in enumerate(zip(wids, sids)):
            if s == 1 and w is not None:
                boxes.append(r["boxes"][w])
                ctx_words.append(w)
                if w == r.get("ans_word_start", -1) and start == 0:
                    start = t
                if w == r.get("ans_word_end", -1):
                    end = t
            else:
                boxes.append(SEP_BOX if enc["input_ids"][t] == self.tok.sep_token_id else PAD_BOX)
                ctx_words.append(-1)
        if end < start:
            start = end = 0
        return {
            "input_ids": torch.tensor(enc["input_ids"]),
            "attention_mask": torch.tensor(enc["attention_mask"]),
            "bbox": torch.tensor(boxes),
            "start_positions": torch.tensor(start),
            "end_positions": torch.tensor(end),
            "ctx_words": torch.tensor(ctx_words),
            "row": torch.tensor(i),
        }


def best_span(start_logits, end_logits, ctx_words, max_len=25):
    mask = ctx_words < 0
    s = start_logits.masked_fill(mask, float("-inf"))
    e = end_logits.masked_fill(mask, float("-inf"))
    scores = s[:, None] + e[None, :]
    scores = torch.triu(scores) - torch.triu(torch.full_like(scores, 1e9), diagonal=max_len)
    flat = scores.argmax().item()
    i, j = divmod(flat, scores.size(1))
    return ctx_words[i].item(), ctx_words[j].item()


def anls(pred, answers, tau=0.5):
    out = 0.0
    for a in answers:
        p, a = pred.lower().strip(), a.lower().strip()
        nl = editdistance.eval(p, a) / max(len(p), len(a), 1)
        out = max(out, 1 - nl if nl < tau else 0.0)
    return out


@torch.no_grad()
def evaluate(model, loader, dataset, device):
    model.eval()
    anls_sum, em_sum, n = 0.0, 0.0, 0
    for batch in loader:
        out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                    bbox=batch["bbox"].to(device))
        for k in range(batch["row"].size(0)):
            row = dataset.rows[batch["row"][k].item()]
            w0, w1 = best_span(out.start_logits[k].float().cpu(), out.end_logits[k].float().cpu(),
                               batch["ctx_words"][k])
            pred = " ".join(row["words"][w0:w1 + 1]) if w0 >= 0 and w1 >= w0 else ""
            anls_sum += anls(pred, row["answers"])
            em_sum += float(any(pred.lower().strip() == a.lower().strip() for a in row["answers"]))
            n += 1
    stats = torch.tensor([anls_sum, em_sum, n], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)
    train_ds = QADataset(args.train_file, tokenizer, args.max_len)
    val_ds = QADataset(args.val_file, tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=32, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)

    model = LiltForQuestionAnswering.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            inputs = {k: batch[k].to(device, non_blocking=True)
                      for k in ("input_ids", "attention_mask", "bbox", "start_positions", "end_positions")}
            loss = model(**inputs).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        val_anls, val_em = evaluate(model, val_loader, val_ds, device)
        logger.info("epoch %d  ANLS %.4f  EM %.4f", epoch, val_anls, val_em)
        if rank == 0 and val_anls > best:
            best = val_anls
            model.module.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
