"""Training-dynamics ("dataset cartography") guided sampling for SST-2.

After every epoch each training sentence is scored with the current model; we
keep the probability of the gold label per epoch. The mean (confidence) and std
(variability) over epochs place each sample on the data map. From epoch
`--map-epochs` on, the sampler up-weights ambiguous (high variability) samples.

    torchrun --nproc_per_node=4 08_cartography_sampler_sst2.py --model distilroberta-base --epochs 8
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding


class WeightedDistributedSampler(torch.utils.data.Sampler):
    def __init__(self, n, num_replicas, rank, seed=0):
        self.weights = torch.ones(n, dtype=torch.double)
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        draw = torch.multinomial(self.weights, self.total_size, replacement=True, generator=g)
        return iter(draw[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="distilroberta-base")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--map-epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--max-len", type=int, default=66)
    ap.add_argument("--var-weight", type=float, default=4.0, help="extra weight for the most ambiguous sample")
    ap.add_argument("--out", default="runs/sst2_cartography")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


@torch.no_grad()
def gold_prob_pass(model, dataset, collator, rank, world, device):
    """Probability of the gold label for every training sample, in dataset order."""
    n = len(dataset)
    shard = list(range(rank, n, world))
    loader = DataLoader(Subset(dataset, shard), batch_size=256, collate_fn=collator, num_workers=2)
    model.eval()
    out = []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        out.append(logits.softmax(-1).gather(1, labels[:, None]).squeeze(1))
    local = torch.cat(out)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    full = torch.empty(n, device=device)
    for r in range(world):
        full[r::world] = gathered[r]
    return full


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        acc[0] += (model(**batch).logits.argmax(-1) == labels).sum()
        acc[1] += labels.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank != 0:
        dist.barrier()
    raw = load_dataset("glue", "sst2")
    enc = raw.map(lambda b: tok(b["sentence"], truncation=True, max_length=args.max_len), batched=True,
                  remove_columns=["sentence", "idx"]).rename_column("label", "labels")
    if rank == 0:
        dist.barrier()
    train, dev = enc["train"], enc["validation"]
    n = len(train)
    collator = DataCollatorWithPadding(tok)

    sampler = WeightedDistributedSampler(n, world, rank, seed=args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                              num_workers=2, drop_last=True)
    dev_loader = DataLoader(dev, batch_size=256, collate_fn=collator,
                            sampler=DistributedSampler(dev, shuffle=False, drop_last=True))

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / (0.1 * total)) * max(0.0, (total - s) / (0.9 * total)))

    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

        history.append(gold_prob_pass(model.module, train, collator, rank, world, device))
        probs = torch.stack(history)
        confidence, variability = probs.mean(0), probs.std(0, unbiased=False)
        if epoch + 1 >= args.map_epochs:
            v = variability / variability.max().clamp(min=1e-6)
            sampler.weights = (1.0 + (args.var_weight - 1.0) * v).double().cpu()

        acc = accuracy(model.module, dev_loader, device)
        if rank == 0:
            easy = ((confidence > 0.8) & (variability < 0.1)).float().mean().item()
            hard = ((confidence < 0.2) & (variability < 0.1)).float().mean().item()
            print(f"epoch {epoch} dev_acc {acc:.4f} easy {easy:.3f} hard {hard:.3f} "
                  f"ambiguous {1 - easy - hard:.3f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "confidence": confidence.cpu(),
                        "variability": variability.cpu(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
