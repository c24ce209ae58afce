"""Memory-augmented autoencoder (MemAE) for bottle-cap inspection.

The latent code is replaced by a sparse combination of learned prototype
("memory") items, so anomalous inputs are reconstructed as normal ones.
Validation loss (held-out good images) decides which checkpoint is kept.

    torchrun --nproc_per_node=4 16_memae_bottlecap.py --train /data/caps/train --val /data/caps/val \
        --ckpt-dir /shared/caps/memae --epochs 150
"""
import argparse
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


class MemoryUnit(nn.Module):
    def __init__(self, mem_dim, fea_dim, shrink_thres=0.0025):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(mem_dim, fea_dim))
        nn.init.kaiming_uniform_(self.weight)
        self.shrink_thres = shrink_thres

    def forward(self, z):
        # z: N x C (flattened spatial positions)
        att = F.softmax(z @ self.weight.t(), dim=1)
        if self.shrink_thres > 0:
            att = F.relu(att - self.shrink_thres) * att / (torch.abs(att - self.shrink_thres) + 1e-12)
            att = F.normalize(att, p=1, dim=1)
        return att @ self.weight, att


class MemAE(nn.Module):
    def __init__(self, mem_dim=2000, chans=(3, 96, 128, 256, 256)):
        super().__init__()
        enc = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            enc += [nn.Conv2d(cin, cout, 3, 2, 1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, True)]
        self.encoder = nn.Sequential(*enc)
        self.memory = MemoryUnit(mem_dim, chans[-1])
        dec = []
        rev = chans[::-1]
        for cin, cout in zip(rev[:-2], rev[1:-1]):
            dec += [nn.ConvTranspose2d(cin, cout, 3, 2, 1, output_padding=1), nn.BatchNorm2d(cout),
                    nn.LeakyReLU(0.2, True)]
        dec += [nn.ConvTranspose2d(rev[-2], rev[-1], 3, 2, 1, output_padding=1)]
        self.decoder = nn.Sequential(*dec)

    def forward(self, x):
        z = self.encoder(x)
        b, c, h, w = z.shape
        zq, att = self.memory(z.permute(0, 2, 3, 1).reshape(-1, c))
        zq = zq.reshape(b, h, w, c).permute(0, 3, 1, 2)
        return self.decoder(zq), att


def entropy_loss(att):
    return (-att * torch.log(att + 1e-12)).sum(dim=1).mean()


def save_checkpoint(state, is_best, ckpt_dir):
    path = os.path.join(ckpt_dir, "checkpoint.pth.tar")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(ckpt_dir, "model_best.pth.tar"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--val", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--img-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--entropy-weight", type=float, default=2e-4)
    parser.add_argument("--mem-dim", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.ckpt_dir, exist_ok=True)

    tf_train = transforms.Compose([transforms.Resize((args.img_size, args.img_size)),
                                   transforms.RandomHorizontalFlip(), transforms.RandomRotation(180),
                                   transforms.ToTensor()])
    tf_val = transforms.Compose([transforms.Resize((args.img_size, args.img_size)), transforms.ToTensor()])
    # ImageFolder with a single "good" class directory
    train_ds = datasets.ImageFolder(args.train, tf_train)
    val_ds = datasets.ImageFolder(args.val, tf_val)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    per_gpu = args.batch_size // world
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=per_gpu, sampler=val_sampler, num_workers=args.workers,
                        pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(MemAE(args.mem_dim)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=10)

    start_epoch, best_val = 0, float("inf")
    last_ckpt = os.path.join(args.ckpt_dir, "checkpoint.pth.tar")
    if args.resume and os.path.exists(last_ckpt):
        ckpt = torch.load(last_ckpt, map_location=device)
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]

    writer = SummaryWriter(os.path.join(args.ckpt_dir, "tb")) if rank == 0 else None

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(3, device=device)
        for x, _ in train_dl:
            x = x.to(device, non_blocking=True)
            rec, att = model(x)
            l_rec = F.mse_loss(rec, x)
            l_ent = entropy_loss(att)
            loss = l_rec + args.entropy_weight * l_ent
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tr += torch.stack([l_rec.detach(), l_ent.detach(), torch.ones((), device=device)])

        model.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, _ in val_dl:
                x = x.to(device, non_blocking=True)
                rec, _ = model(x)
                va += torch.stack([F.mse_loss(rec, x, reduction="sum") / x[0].numel(),
                                   torch.tensor(float(x.shape[0]), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(va)
        val_loss = (va[0] / va[1]).item()
        scheduler.step(val_loss)

        is_best = val_loss < best_val
        best_val = min(best_val, val_loss)
        save_checkpoint({"epoch": epoch, "state_dict": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                         "best_val": best_val, "args": vars(args)}, is_best, args.ckpt_dir)

        if rank == 0:
            n = tr[2].item()
            writer.add_scalar("train/rec", tr[0].item() / n, epoch)
            writer.add_scalar("train/entropy", tr[1].item() / n, epoch)
            writer.add_scalar("val/rec", val_loss, epoch)
            writer.add_scalar("lr", optimizer.param_groups[0]["lr"], epoch)
            print(f"epoch {epoch:3d}  rec {tr[0].item() / n:.5f}  val {val_loss:.5f}"
                  f"{'  *' if is_best else ''}  {time.time() - t0:.0f}s", flush=True)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
