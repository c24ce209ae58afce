"""Fine-tune a BERT-large classifier with DTensor tensor parallelism inside
pairs of GPUs and FSDP2 across the data-parallel dimension.

    torchrun --standalone --nproc_per_node=8 20_tp_bert_classifier.py --tp 2 \
        --model bert-large-uncased --train data/reviews_train.csv --val data/reviews_val.csv
"""
import argparse
import csv
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-large-uncased")
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--out", default="out/bert_tp")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-labels", type=int, default=5)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    return p.parse_args()


class CsvReviews(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        self.labels = [int(r["label"]) for r in rows]
        self.enc = tok([r["text"] for r in rows], truncation=True, max_length=max_len, padding="max_length")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        item = {k: torch.tensor(v[i]) for k, v in self.enc.items()}
        item["labels"] = torch.tensor(self.labels[i])
        return item


def apply_tp(model, tp_mesh):
    tp = tp_mesh.size()
    for layer in model.bert.encoder.layer:
        att = layer.attention.self
        att.num_attention_heads //= tp
        att.all_head_size //= tp
        parallelize_module(layer, tp_mesh, {
            "attention.self.query": ColwiseParallel(),
            "attention.self.key": ColwiseParallel(),
            "attention.self.value": ColwiseParallel(),
            "attention.output.dense": RowwiseParallel(),
            "intermediate.dense": ColwiseParallel(),
            "output.dense": RowwiseParallel(),
        })


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        loss_sum += out.loss.item() * batch["labels"].size(0)
        correct += (out.logits.argmax(-1) == batch["labels"]).sum().item()
        total += batch["labels"].size(0)
    model.train()
    return loss_sum / total, correct / total


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(a.model)
    train_ds = CsvReviews(a.train, tok, a.max_len)
    val_ds = CsvReviews(a.val, tok, a.max_len)
    # TP peers need identical batches, so shard over the dp dimension only
    train_sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    train_dl = DataLoader(train_ds, a.batch_size, sampler=train_sampler, num_workers=2, drop_last=True)
    val_dl = DataLoader(val_ds, a.batch_size, sampler=val_sampler, num_workers=2)

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=a.num_labels,
                                                               attn_implementation="sdpa").to(device)
    apply_tp(model, mesh["tp"])
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr)
    total_steps = a.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(a.warmup_ratio * total_steps), total_steps)

    history = []
    best_acc, best_epoch = 0.0, -1
    for epoch in range(a.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if it % 50 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(train_dl)} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        val_loss, val_acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc * 100:.2f}", flush=True)
            history.append({"epoch": epoch, "val_loss": val_loss, "val_acc": val_acc})
            if val_acc > best_acc:
                best_acc, best_epoch = val_acc, epoch

        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(a.out, f"epoch{epoch}"))

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"best_epoch": best_epoch, "best_val_acc": best_acc, "history": history}, f, indent=2)
        print(f"best epoch {best_epoch}: val_acc {best_acc * 100:.2f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
