"""
Attention-head pruning of a fine-tuned BERT on SST-2 (Michel et al., 2019):
head importance = |d loss / d head_mask| accumulated over the training set,
heads with the lowest normalised importance are removed with `prune_heads`,
then the pruned model is fine-tuned again to recover accuracy. Accuracy and
CPU latency are logged before and after.

    torchrun --nproc_per_node=4 prune_heads_sst2.py --model /shared/ckpt/bert-base-sst2 --prune-ratio 0.4
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="/shared/data/sst2_tokenized")
    p.add_argument("--prune-ratio", type=float, default=0.4)
    p.add_argument("--importance-batches", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", default="/shared/ckpt/bert-sst2-headpruned")
    return p.parse_args()


def compute_head_importance(model, loader, device, max_batches):
    cfg = model.config
    head_importance = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads)
    head_mask = torch.ones(cfg.num_hidden_layers, cfg.num_attention_heads, device=device, requires_grad=True)
    model.eval()
    n_tokens = 0
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch, head_mask=head_mask)
        out.loss.backward()
        head_importance += head_mask.grad.abs().detach().cpu()
        head_mask.grad = None
        model.zero_grad(set_to_none=True)
        n_tokens += int(batch["attention_mask"].sum())
    return head_importance, n_tokens


def normalise(imp):
    # layer-wise L2 normalisation, then global min-max
    imp = imp / imp.pow(2).sum(-1, keepdim=True).sqrt().clamp_min(1e-20)
    return (imp - imp.min()) / (imp.max() - imp.min())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        c[0] += (model(**batch).logits.argmax(-1) == labels).sum()
        c[1] += labels.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


@torch.no_grad()
def cpu_latency(model, tok, seq_len=128, runs=30):
    m = model.to("cpu").eval()
    x = tok(["a " * (seq_len - 2)], return_tensors="pt", truncation=True, max_length=seq_len)
    for _ in range(5):
        m(**x)
    t0 = time.perf_counter()
    for _ in range(runs):
        m(**x)
    return (time.perf_counter() - t0) / runs * 1e3


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    data = load_from_disk(args.data)
    data.set_format("torch", columns=["input_ids", "token_type_ids", "attention_mask", "labels"])
    collate = DataCollatorWithPadding(tok)
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=0)
    train_loader = DataLoader(data["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, drop_last=True)
    val_loader = DataLoader(data["validation"], batch_size=128, collate_fn=collate,
                            sampler=DistributedSampler(data["validation"], shuffle=False))

    model = AutoModelForSequenceClassification.from_pretrained(args.model).to(device)
    acc_dense = evaluate(model, val_loader, device)

    # each rank scores heads on its own shard; sum the scores over ranks
    imp, n_tok = compute_head_importance(model, train_loader, device, args.importance_batches)
    dist.all_reduce(imp)
    imp = normalise(imp)

    n_heads = imp.numel()
    n_prune = int(args.prune_ratio * n_heads)
    order = imp.flatten().argsort()
    to_prune = {}
    for idx in order[:n_prune].tolist():
        layer, head = divmod(idx, model.config.num_attention_heads)
        to_prune.setdefault(layer, []).append(head)
    # keep at least one head in every layer
    for layer, heads in list(to_prune.items()):
        if len(heads) == model.config.num_attention_heads:
            heads.remove(int(imp[layer].argmax()))
    model.prune_heads(to_prune)
    acc_pruned = evaluate(model, val_loader, device)
    if rank == 0:
        print(f"dense acc {acc_dense:.4f} -> pruned (no ft) {acc_pruned:.4f}, "
              f"removed {sum(len(h) for h in to_prune.values())}/{n_heads} heads", flush=True)

    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = ddp(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ft ep {epoch} step {step} loss {loss.item():.4f}", flush=True)
        acc_ft = evaluate(ddp, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: acc after ft {acc_ft:.4f}", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        ddp.module.save_pretrained(args.out)
        tok.save_pretrained(args.out)
        with open(os.path.join(args.out, "pruned_heads.json"), "w") as f:
            json.dump({str(k): v for k, v in to_prune.items()}, f)
        lat = cpu_latency(ddp.module, tok)
        print(f"final acc {acc_ft:.4f}, cpu latency {lat:.1f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
