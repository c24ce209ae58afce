"""
TIGER-style seq2seq recommender trained with HF Accelerate (multi-GPU DDP).

    accelerate launch --multi_gpu --num_processes 8 16_tiger_beam_eval.py --data_dir data/beauty

Model selection uses Recall@10 from beam search on the validation users; the selected
checkpoint is then evaluated once on the test users.
"""
import argparse
import json
import logging
import math
import os

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import T5Config, T5ForConditionalGeneration, get_scheduler

logger = get_logger(__name__)
PAD, EOS = 0, 1


class TigerDataset(Dataset):
    def __init__(self, seqs, sem, K, split, max_items):
        self.sem, self.K = sem, K
        self.rows = []
        for s in seqs:
            if split == "train":
                self.rows += [(s[max(0, t - max_items):t], s[t]) for t in range(1, len(s) - 2)]
            elif split == "valid":
                self.rows.append((s[-2 - max_items:-2], s[-2]))
            else:
                self.rows.append((s[-1 - max_items:-1], s[-1]))

    def codes(self, it):
        return [2 + l * self.K + int(c) for l, c in enumerate(self.sem[it])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        h, t = self.rows[i]
        return {"src": [x for it in h for x in self.codes(it)], "tgt": self.codes(t) + [EOS]}


def collate(batch):
    L = max(len(b["src"]) for b in batch)
    ids = torch.zeros(len(batch), L, dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, :len(b["src"])] = torch.tensor(b["src"])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(),
            "labels": torch.tensor([b["tgt"] for b in batch])}


@torch.no_grad()
def beam_eval(accelerator, model, loader, n_levels, num_beams=20, ks=(5, 10)):
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    recall = {k: 0.0 for k in ks}
    ndcg = {k: 0.0 for k in ks}
    n = 0
    for batch in loader:
        out = unwrapped.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 num_beams=num_beams, num_return_sequences=num_beams,
                                 max_new_tokens=n_levels + 1)
        bsz = batch["input_ids"].size(0)
        cand = out[:, 1:n_levels + 1].reshape(bsz, num_beams, n_levels)
        match = (cand == batch["labels"][:, None, :n_levels]).all(-1)
        first = match.float().argmax(-1)
        for k in ks:
            hit = match[:, :k].any(-1).float()
            recall[k] += hit.sum().item()
            ndcg[k] += (hit / torch.log2(first.float() + 2)).sum().item()
        n += bsz
    model.train()
    res = {f"recall@{k}": recall[k] / n for k in ks}
    res.update({f"ndcg@{k}": ndcg[k] / n for k in ks})
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--max_items", type=int, default=20)
    ap.add_argument("--per_device_batch_size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--warmup_steps", type=int, default=5000)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--mixed_precision", default="bf16")
    ap.add_argument("--output_dir", default="outputs/tiger_beauty")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision, log_with="tensorboard",
                              project_dir=args.output_dir)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s", level=logging.INFO)
    set_seed(args.seed)

    sem = np.load(os.path.join(args.data_dir, "sem_ids.npy"))
    n_levels = sem.shape[1]
    with open(os.path.join(args.data_dir, "seqs.json")) as f:
        seqs = json.load(f)
    train_ds = TigerDataset(seqs, sem, args.K, "train", args.max_items)
    valid_ds = TigerDataset(seqs, sem, args.K, "valid", args.max_items)
    test_ds = TigerDataset(seqs, sem, args.K, "test", args.max_items)

    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch_size, shuffle=True, collate_fn=collate,
                          num_workers=4, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=128, collate_fn=collate)
    test_dl = DataLoader(test_ds, batch_size=128, collate_fn=collate)

    cfg = T5Config(vocab_size=2 + n_levels * args.K, d_model=128, d_ff=1024, d_kv=64, num_layers=4,
                   num_heads=6, dropout_rate=0.1, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    model = T5ForConditionalGeneration(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.035)

    model, optimizer, train_dl, valid_dl, test_dl = accelerator.prepare(model, optimizer, train_dl, valid_dl, test_dl)
    steps_total = args.epochs * len(train_dl)
    # not passed to prepare(): it is stepped once per optimizer step on every process
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=steps_total)
    accelerator.init_trackers("tiger", config=vars(args))

    best, best_path = -1.0, os.path.join(args.output_dir, "best")
    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros(2, device=accelerator.device)
        for batch in train_dl:
            with accelerator.autocast():
                loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total += torch.stack([loss.detach().float(), torch.ones((), device=accelerator.device)])
        total = accelerator.reduce(total, reduction="sum")
        accelerator.log({"train/loss": (total[0] / total[1]).item(), "lr": scheduler.get_last_lr()[0]}, step=epoch)

        if (epoch + 1) % args.eval_every == 0:
            metrics = beam_eval(accelerator, model, valid_dl, n_levels)
            accelerator.log({f"valid/{k}": v for k, v in metrics.items()}, step=epoch)
            logger.info(f"epoch {epoch}: {metrics}", main_process_only=True)
            if metrics["recall@10"] > best:
                best = metrics["recall@10"]
                accelerator.wait_for_everyone()
                accelerator.save_state(best_path)

    accelerator.wait_for_everyone()
    accelerator.load_state(best_path)
    test_metrics = beam_eval(accelerator, model, test_dl, n_levels)
    logger.info(f"test: {test_metrics}", main_process_only=True)
    accelerator.log({f"test/{k}": v for k, v in test_metrics.items()}, step=args.epochs)
    accelerator.end_training()


if __name__ == "__main__":
    main()
