"""Active learning for intent classification on MASSIVE (en-US, 60 intents).

XLM-R large is trained with DeepSpeed ZeRO-3. After the first round the model is
warm-started from the previous round's weights instead of the pretrained ones.

    deepspeed --num_gpus=8 15_al_massive_intent_zero3.py --out /shared/al/massive_margin
"""
import argparse
import gc
import json
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="xlm-roberta-large")
    p.add_argument("--out", required=True)
    p.add_argument("--init", type=int, default=600)
    p.add_argument("--query", type=int, default=600)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--global_bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=1.5e-5)
    p.add_argument("--warm_start", action="store_true", default=True)
    p.add_argument("--seed", type=int, default=101)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class Utterances(Dataset):
    def __init__(self, enc, labels, indices):
        self.enc, self.labels, self.indices = enc, labels, np.asarray(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        j = int(self.indices[i])
        return {"input_ids": self.enc["input_ids"][j], "attention_mask": self.enc["attention_mask"][j],
                "labels": int(self.labels[j]), "row": j}


def loader_for(enc, labels, indices, bs, collate, shuffle, seed=0):
    ds = Utterances(enc, labels, indices)
    sampler = DistributedSampler(ds, shuffle=shuffle, seed=seed)
    return DataLoader(ds, batch_size=bs, sampler=sampler, collate_fn=collate, num_workers=2), sampler


def all_gather_cat(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


@torch.no_grad()
def infer(engine, loader, device):
    engine.eval()
    probs, rows = [], []
    for b in loader:
        rows.append(b.pop("row").to(device))
        b.pop("labels")
        out = engine(**{k: v.to(device) for k, v in b.items()})
        probs.append(out.logits.float().softmax(-1))
    probs, rows = all_gather_cat(torch.cat(probs)), all_gather_cat(torch.cat(rows))
    _, first = np.unique(rows.cpu().numpy(), return_index=True)
    first = torch.as_tensor(first, device=device)
    return probs[first], rows[first]


def main():
    args = cli()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank != 0:
        dist.barrier()
    massive = load_dataset("AmazonScience/massive", "en-US")
    if rank == 0:
        dist.barrier()
    n_labels = massive["train"].features["intent"].num_classes
    tok = AutoTokenizer.from_pretrained(args.model)
    tr_enc = tok(massive["train"]["utt"], truncation=True, max_length=64)
    te_enc = tok(massive["test"]["utt"], truncation=True, max_length=64)
    tr_y, te_y = np.asarray(massive["train"]["intent"]), np.asarray(massive["test"]["intent"])
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)

    rng = np.random.default_rng(args.seed)
    labelled = np.sort(rng.choice(len(tr_y), args.init, replace=False))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    prev_weights = None
    curve = []

    for rnd in range(args.rounds):
        t0 = time.time()
        micro_bs = args.global_bs // world
        train_loader, sampler = loader_for(tr_enc, tr_y, labelled, micro_bs, collate, True, args.seed + rnd)
        total_steps = args.epochs * len(train_loader)
        config = {
            "train_micro_batch_size_per_gpu": micro_bs,
            "gradient_accumulation_steps": 1,
            "train_batch_size": micro_bs * world,
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                  "stage3_param_persistence_threshold": 1e5},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR",
                          "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                     "warmup_num_steps": max(1, total_steps // 10),
                                     "total_num_steps": max(2, total_steps)}},
            "steps_per_print": 10 ** 9,
        }
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=n_labels)
        if args.warm_start and prev_weights is not None:
            model.load_state_dict(torch.load(prev_weights, map_location="cpu"))
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            engine.train()
            for b in train_loader:
                b.pop("row")
                loss = engine(**{k: v.to(device) for k, v in b.items()}).loss
                engine.backward(loss)
                engine.step()

        test_loader, _ = loader_for(te_enc, te_y, np.arange(len(te_y)), 128, collate, False)
        probs, rows = infer(engine, test_loader, device)
        acc = (probs.argmax(-1).cpu().numpy() == te_y[rows.cpu().numpy()]).mean()

        unlabelled = np.setdiff1d(np.arange(len(tr_y)), labelled)
        pool_loader, _ = loader_for(tr_enc, tr_y, unlabelled, 128, collate, False)
        probs, rows = infer(engine, pool_loader, device)
        top2 = probs.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        chosen = rows[torch.topk(-margin, min(args.query, len(rows))).indices].cpu().numpy()

        prev_weights = os.path.join(args.out, f"round{rnd}_weights.pt")
        if rank == 0:
            torch.save(engine.module.state_dict(), prev_weights)
        dist.barrier()

        curve.append({"round": rnd, "n_labelled": int(len(labelled)), "test_acc": float(acc),
                      "minutes": (time.time() - t0) / 60})
        labelled = np.union1d(labelled, chosen)
        if rank == 0:
            print(curve[-1], flush=True)
            with open(os.path.join(args.out, "curve.json"), "w") as f:
                json.dump({"curve": curve, "labelled": labelled.tolist()}, f)

        engine.destroy()
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
