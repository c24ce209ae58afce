"""BADGE active learning for IMDB sentiment with RoBERTa-large under DeepSpeed ZeRO-3.

    deepspeed --num_gpus=8 06_al_imdb_badge_zero3.py --output_dir /shared/al/imdb_badge
"""
import argparse
import gc
import json
import os

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="roberta-large")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--init_size", type=int, default=100)
    p.add_argument("--query_size", type=int, default=100)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--candidates", type=int, default=10000, help="random pool subsample scored per round")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train_batch_size", type=int, default=32, help="global batch")
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return p.parse_args()


class Encoded(Dataset):
    def __init__(self, enc, labels):
        self.enc, self.labels = enc, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        item = {k: v[i] for k, v in self.enc.items()}
        item["labels"] = int(self.labels[i])
        item["idx"] = i
        return item


class IndexSubset(Dataset):
    def __init__(self, ds, indices):
        self.ds, self.indices = ds, list(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.ds[self.indices[i]]


def ds_config(args, grad_accum, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": args.train_batch_size,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": max(1, total_steps // 10),
                                 "total_num_steps": max(2, total_steps)}},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def make_loader(ds, indices, batch, collate, shuffle, seed=0):
    sub = IndexSubset(ds, indices)
    # DistributedSampler pads so every rank runs the same number of forwards (ZeRO-3 gathers
    # parameters inside each forward); padded duplicates are removed again via "idx"
    sampler = DistributedSampler(sub, shuffle=shuffle, seed=seed)
    return DataLoader(sub, batch_size=batch, sampler=sampler, collate_fn=collate, num_workers=2), sampler


def gather_cat(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


@torch.no_grad()
def predict(engine, loader, device, want_emb=False):
    """Returns (idx, probs, penultimate) with the padding duplicates dropped."""
    captured = {}
    head = engine.module.classifier.out_proj
    hook = head.register_forward_hook(lambda m, inp, out: captured.__setitem__("h", inp[0])) if want_emb else None
    engine.eval()
    idxs, probs, embs = [], [], []
    for batch in loader:
        idx = batch.pop("idx").to(device)
        batch.pop("labels")
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = engine(**batch).logits.float()
        idxs.append(idx)
        probs.append(logits.softmax(-1))
        if want_emb:
            embs.append(captured["h"].float())
    if hook is not None:
        hook.remove()
    idx = gather_cat(torch.cat(idxs))
    prob = gather_cat(torch.cat(probs))
    emb = gather_cat(torch.cat(embs)) if want_emb else None
    _, first = np.unique(idx.cpu().numpy(), return_index=True)
    first = torch.as_tensor(first, device=device)
    return idx[first], prob[first], (emb[first] if want_emb else None)


def kmeans_pp(x, k, seed):
    """k-means++ seeding on the rows of x (BADGE's selection step)."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    first = int(torch.argmax(x.norm(dim=1)))
    chosen = [first]
    d2 = ((x - x[first]) ** 2).sum(1)
    for _ in range(1, k):
        p = d2 / d2.sum()
        j = int(torch.multinomial(p, 1, generator=g))
        chosen.append(j)
        d2 = torch.minimum(d2, ((x - x[j]) ** 2).sum(1))
    return chosen


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if args.train_batch_size % (args.micro_batch * world):
        raise ValueError("train_batch_size must be a multiple of micro_batch * world_size")
    grad_accum = args.train_batch_size // (args.micro_batch * world)

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank != 0:
        dist.barrier()
    raw = load_dataset("imdb")
    if rank == 0:
        dist.barrier()
    train_enc = tok(raw["train"]["text"], truncation=True, max_length=args.max_len)
    test_enc = tok(raw["test"]["text"], truncation=True, max_length=args.max_len)
    train_ds = Encoded(train_enc, raw["train"]["label"])
    test_ds = Encoded(test_enc, raw["test"]["label"])
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)

    rng = np.random.default_rng(args.seed)
    labelled = np.sort(rng.choice(len(train_ds), args.init_size, replace=False))
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    history = []
    for rnd in range(args.rounds):
        train_loader, train_sampler = make_loader(train_ds, labelled, args.micro_batch, collate,
                                                  shuffle=True, seed=args.seed + rnd)
        steps = args.epochs * len(train_loader) // grad_accum
        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(args, grad_accum, steps))

        for epoch in range(args.epochs):
            train_sampler.set_epoch(epoch)
            engine.train()
            for batch in train_loader:
                batch.pop("idx")
                batch = {k: v.to(device) for k, v in batch.items()}
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()

        test_loader, _ = make_loader(test_ds, np.arange(len(test_ds)), 64, collate, shuffle=False)
        t_idx, t_prob, _ = predict(engine, test_loader, device)
        t_labels = torch.as_tensor(np.asarray(raw["test"]["label"]), device=device)[t_idx]
        test_acc = (t_prob.argmax(-1) == t_labels).float().mean().item()

        # BADGE: hallucinated last-layer gradient embeddings on a random candidate subset
        unlabelled = np.setdiff1d(np.arange(len(train_ds)), labelled)
        cand = np.sort(np.random.default_rng(args.seed * 1000 + rnd).choice(
            unlabelled, min(args.candidates, len(unlabelled)), replace=False))
        pool_loader, _ = make_loader(train_ds, cand, 64, collate, shuffle=False)
        c_idx, c_prob, c_h = predict(engine, pool_loader, device, want_emb=True)
        onehot = F.one_hot(c_prob.argmax(-1), c_prob.shape[-1]).float()
        g = ((onehot - c_prob)[:, :, None] * c_h[:, None, :]).flatten(1)

        picked = [None]
        if rank == 0:
            sel = kmeans_pp(g, min(args.query_size, len(g)), seed=args.seed + rnd)
            picked[0] = c_idx[sel].cpu().tolist()
        dist.broadcast_object_list(picked, src=0)

        # every rank takes part in both saves: ZeRO-3 gathers the shards for the 16-bit file
        engine.save_checkpoint(os.path.join(args.output_dir, "ds_ckpt"), tag=f"round{rnd}")
        engine.save_16bit_model(os.path.join(args.output_dir, "hf16"), f"round{rnd}.bin")

        history.append({"round": rnd, "n_labelled": int(len(labelled)), "test_acc": test_acc})
        labelled = np.union1d(labelled, np.asarray(picked[0], dtype=np.int64))
        if rank == 0:
            print(f"round {rnd}: {history[-1]}", flush=True)
            with open(os.path.join(args.output_dir, "history.json"), "w") as f:
                json.dump({"history": history, "labelled": labelled.tolist()}, f)

        engine.destroy()
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
