"""EfficientNet-B0 on a plant-disease image folder, with Keras-style metric objects.

Metrics follow tf.keras.metrics semantics: update_state() per batch, result()
returns the value over all replicas, reset_state() at the start of each epoch.

    torchrun --nproc_per_node=4 12_effnet_progbar_metrics.py --data /data/plantvillage --epochs 30
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Metric:
    def __init__(self, name, device):
        self.name = name
        self.device = device
        self.reset_state()

    def reset_state(self):
        self.value = torch.zeros(2, dtype=torch.float64, device=self.device)

    def result(self):
        v = self.value.clone()
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
        return (v[0] / v[1].clamp(min=1.0)).item()


class Mean(Metric):
    def update_state(self, x, n=1):
        self.value[0] += float(x) * n
        self.value[1] += n


class CategoricalAccuracy(Metric):
    def update_state(self, y_true, logits):
        self.value[0] += (logits.argmax(1) == y_true).sum()
        self.value[1] += y_true.numel()


class TopKCategoricalAccuracy(Metric):
    def __init__(self, name, device, k=5):
        super().__init__(name, device)
        self.k = k

    def update_state(self, y_true, logits):
        self.value[0] += (logits.topk(self.k, 1).indices == y_true[:, None]).any(1).sum()
        self.value[1] += y_true.numel()


class Trainer:
    def __init__(self, model, optimizer, scheduler, device, rank, ckpt_dir):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device, self.rank, self.ckpt_dir = device, rank, ckpt_dir
        self.is_chief = rank == 0
        self.train_metrics = [Mean("loss", device), CategoricalAccuracy("accuracy", device)]
        self.val_metrics = [Mean("val_loss", device), CategoricalAccuracy("val_accuracy", device),
                            TopKCategoricalAccuracy("val_top5", device, k=5)]
        self.best = 0.0

    def fit(self, train_loader, sampler, val_loader, epochs):
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for m in self.train_metrics + self.val_metrics:
                m.reset_state()
            t0 = time.time()
            self.model.train()
            for x, y in train_loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = self.model(x)
                    loss = F.cross_entropy(logits, y, label_smoothing=0.1)
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.train_metrics[0].update_state(loss.detach(), y.size(0))
                self.train_metrics[1].update_state(y, logits.detach())
            self.scheduler.step()
            self.evaluate(val_loader)

            if self.is_chief:
                logs = {m.name: m.result() for m in self.train_metrics + self.val_metrics}
                print(f"Epoch {epoch + 1}/{epochs} - {time.time() - t0:.0f}s - "
                      + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()), flush=True)
                if logs["val_accuracy"] > self.best:
                    self.best = logs["val_accuracy"]
                    torch.save({"epoch": epoch, "model": self.model.module.state_dict(), "logs": logs},
                               os.path.join(self.ckpt_dir, "effnet_b0_best.pt"))

    @torch.no_grad()
    def evaluate(self, loader):
        self.model.eval()
        for x, y in loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(x)
            self.val_metrics[0].update_state(F.cross_entropy(logits.float(), y), y.size(0))
            self.val_metrics[1].update_state(y, logits)
            self.val_metrics[2].update_state(y, logits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--img-size", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=64, help="per replica")
    ap.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--ckpt-dir", default="checkpoints/effnet_plants")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(123)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.img_size), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2), transforms.ToTensor(), norm]))
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(int(args.img_size * 1.14)), transforms.CenterCrop(args.img_size), transforms.ToTensor(),
        norm]))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=123)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128, num_workers=8,
                            pin_memory=True)

    model = timm.create_model("efficientnet_b0", pretrained=True, num_classes=len(train_ds.classes))
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"classes={len(train_ds.classes)} train={len(train_ds)} val={len(val_ds)} "
              f"replicas={world} lr={lr:.2e}")

    trainer = Trainer(model, optimizer, scheduler, device, rank, args.ckpt_dir)
    trainer.scaler = torch.cuda.amp.GradScaler()
    trainer.fit(train_loader, sampler, val_loader, args.epochs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
