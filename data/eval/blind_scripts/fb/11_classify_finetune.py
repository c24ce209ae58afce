"""Fine-tune a decoder LM as a multi-class safety classifier (ZeRO-1, fp16).

deepspeed --num_gpus 4 classify_finetune.py --deepspeed_config configs/zero1_fp16.json \
    --csv data/safety_labels_v2.csv --model meta-llama/Llama-2-7b-hf --out ckpt/safety-clf
"""
import argparse
import json
import os

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--text_col", default="text")
    parser.add_argument("--label_col", default="category")
    parser.add_argument("--val_frac", type=float, default=0.1)
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class TextClsDataset(Dataset):
    def __init__(self, texts, labels, tok, max_len):
        self.texts, self.labels, self.tok, self.max_len = texts, labels, tok, max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len)
        return {"idx": i, "input_ids": enc["input_ids"], "label": self.labels[i]}


def collate_fn(pad_id):
    def collate(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            att[i, :n] = 1
        y = torch.tensor([b["label"] for b in batch], dtype=torch.long)
        return ids, att, y, [b["idx"] for b in batch]
    return collate


def load_splits(args):
    df = pd.read_csv(args.csv)
    df = df.dropna(subset=[args.text_col, args.label_col]).reset_index(drop=True)
    classes = sorted(df[args.label_col].unique().tolist())
    label2id = {c: i for i, c in enumerate(classes)}
    y = df[args.label_col].map(label2id).values
    perm = np.random.permutation(len(df))
    n_val = int(len(df) * args.val_frac)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    texts = df[args.text_col].tolist()
    train = ([texts[i] for i in train_idx], y[train_idx].tolist())
    val = ([texts[i] for i in val_idx], y[val_idx].tolist())
    return train, val, label2id


@torch.no_grad()
def evaluate(engine, loader, world):
    engine.eval()
    local = {}
    for ids, att, y, idx in loader:
        logits = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device)).logits
        for i, p, t in zip(idx, logits.argmax(-1).tolist(), y.tolist()):
            local[i] = (p, t)
    engine.train()
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    merged = {}
    for g in gathered:
        merged.update(g)
    all_p = [merged[i][0] for i in sorted(merged)]
    all_y = [merged[i][1] for i in sorted(merged)]
    acc = float(np.mean(np.array(all_p) == np.array(all_y)))
    macro_f1 = f1_score(all_y, all_p, average="macro")
    return acc, macro_f1


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    (tr_x, tr_y), (va_x, va_y), label2id = load_splits(args)
    if rank == 0:
        print(f"{len(tr_x)} train / {len(va_x)} val, {len(label2id)} classes", flush=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.unk_token
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(label2id), id2label={v: k for k, v in label2id.items()}, label2id=label2id
    )
    model.config.pad_token_id = tok.pad_token_id

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    mbs = engine.train_micro_batch_size_per_gpu()

    train_ds = TextClsDataset(tr_x, tr_y, tok, args.max_len)
    val_ds = TextClsDataset(va_x, va_y, tok, args.max_len)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    tr_dl = DataLoader(train_ds, batch_size=mbs, sampler=tr_sampler, collate_fn=collate_fn(tok.pad_token_id),
                       num_workers=2)
    va_dl = DataLoader(val_ds, batch_size=mbs * 2, sampler=DistributedSampler(val_ds, shuffle=False),
                       collate_fn=collate_fn(tok.pad_token_id), num_workers=2)

    best_f1 = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for ids, att, y, _ in tr_dl:
            out = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device),
                         labels=y.to(engine.device))
            engine.backward(out.loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 50 == 0 and rank == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {out.loss.item():.4f}", flush=True)

        acc, f1 = evaluate(engine, va_dl, world)
        if rank == 0:
            print(f"[val] epoch {epoch} acc {acc:.4f} macro_f1 {f1:.4f}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"macro_f1": f1})
        if f1 > best_f1:
            best_f1 = f1
            if rank == 0:
                best_dir = os.path.join(args.out, "best_hf")
                engine.module.save_pretrained(best_dir)
                tok.save_pretrained(best_dir)
                with open(os.path.join(best_dir, "metrics.json"), "w") as f:
                    json.dump({"epoch": epoch, "acc": acc, "macro_f1": f1}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
