"""
DeBERTa-v3-large sentence-pair classification with DeepSpeed ZeRO-3.
Evaluates accuracy / macro-F1 on the dev set every --eval_interval steps and keeps the
best weights as a plain PyTorch state_dict for the downstream inference service.

    deepspeed --num_gpus 8 12_ds_zero3_cls_finetune.py \
        --train data/nli_train.jsonl --dev data/nli_dev.jsonl --out ckpt/deberta_nli
"""
import argparse
import json
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer

LABELS = ["entailment", "neutral", "contradiction"]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="microsoft/deberta-v3-large")
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--out", default="ckpt/deberta_nli")
    parser.add_argument("--max_len", type=int, default=256)
    parser.add_argument("--micro_bs", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval_interval", type=int, default=1000)
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def make_ds_config(args, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": int(0.06 * total_steps), "total_num_steps": total_steps}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 200,
        "wall_clock_breakdown": False,
    }


class PairDataset(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f if l.strip()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return i, r["premise"], r["hypothesis"], LABELS.index(r["label"])


class PairCollator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        idx, a, b, y = zip(*batch)
        enc = self.tok(list(a), list(b), truncation=True, max_length=self.max_len,
                       padding=True, return_tensors="pt")
        enc["labels"] = torch.tensor(y)
        enc["idx"] = torch.tensor(idx)
        return enc


@torch.no_grad()
def evaluate(engine, loader, n_dev, device):
    """ZeRO-3 forward all-gathers parameters, so every rank must run the same number of
    batches: the dev sampler pads, and padded duplicates are dropped by index afterwards."""
    engine.eval()
    idxs, preds, golds = [], [], []
    for batch in loader:
        idx = batch.pop("idx").to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = engine(**batch).logits
        idxs.append(idx)
        preds.append(logits.argmax(-1))
        golds.append(batch["labels"])
    local = torch.stack([torch.cat(idxs), torch.cat(preds), torch.cat(golds)])
    world = dist.get_world_size()
    buf = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(buf, local)
    allv = torch.cat(buf, dim=1).cpu().numpy()
    _, first = np.unique(allv[0], return_index=True)
    p, g = allv[1, first], allv[2, first]
    assert len(first) == n_dev
    engine.train()
    return float((p == g).mean()), float(f1_score(g, p, average="macro"))


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=len(LABELS))

    train_set, dev_set = PairDataset(args.train), PairDataset(args.dev)
    collate = PairCollator(tok, args.max_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=42)
    dev_sampler = DistributedSampler(dev_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.micro_bs, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=64, sampler=dev_sampler, collate_fn=collate, num_workers=4)

    total_steps = len(train_loader) * args.epochs // args.grad_accum
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=make_ds_config(args, total_steps))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} micro_bs={args.micro_bs} accum={args.grad_accum} "
              f"global batch={args.micro_bs * args.grad_accum * world} optimizer steps={total_steps}")

    best_acc, micro_step = 0.0, 0
    history = []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        for batch in train_loader:
            batch.pop("idx")
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            micro_step += 1

            if micro_step % (args.eval_interval * args.grad_accum) == 0:
                acc, f1 = evaluate(engine, dev_loader, len(dev_set), device)
                history.append({"step": engine.global_steps, "acc": acc, "macro_f1": f1})
                if rank == 0:
                    print(f"[eval] epoch {epoch} step {engine.global_steps}: acc={acc:.4f} "
                          f"macro_f1={f1:.4f} ({time.time() - t0:.0f}s since epoch start)", flush=True)
                    if acc > best_acc:
                        best_acc = acc
                        torch.save(engine.module.state_dict(), os.path.join(args.out, "best_model.bin"))
                        tok.save_pretrained(args.out)
                        engine.module.config.save_pretrained(args.out)
                        print(f"[eval] new best acc {best_acc:.4f}, saved", flush=True)

        # full training state (sharded) for resumption
        engine.save_checkpoint(os.path.join(args.out, "ds_state"), tag=f"epoch{epoch}")

    if rank == 0:
        with open(os.path.join(args.out, "eval_history.json"), "w") as f:
            json.dump(history, f, indent=2)
        print(f"finished, best dev acc {best_acc:.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
