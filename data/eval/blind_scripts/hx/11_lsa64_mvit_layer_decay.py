"""LSA64 (Argentinian Sign Language, 64 signs x 10 signers x 5 repetitions) with MViTv2-S
fine-tuned from Kinetics-400, signer-independent split, layer-wise lr decay.

File names are SSS_PPP_RRR.mp4 (sign, signer/person, repetition).

    torchrun --nproc_per_node=4 11_lsa64_mvit_layer_decay.py --video-dir /data/lsa64/all_cut --val-signers 9 10
"""
import argparse
import glob
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.v2 as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.io import read_video
from torchvision.models.video import MViT_V2_S_Weights, mvit_v2_s


class LSA64(Dataset):
    def __init__(self, files, num_frames=16, train=True):
        self.files = files
        self.num_frames = num_frames
        self.train = train
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), ratio=(0.8, 1.25)),
                                 T.ColorJitter(0.3, 0.3, 0.2)])
        else:
            self.tf = T.Compose([T.Resize(224), T.CenterCrop(224)])
        self.norm = T.Normalize([0.45, 0.45, 0.45], [0.225, 0.225, 0.225])

    def __len__(self):
        return len(self.files)

    @staticmethod
    def label_of(path):
        return int(os.path.basename(path).split("_")[0]) - 1

    def __getitem__(self, i):
        video, _, _ = read_video(self.files[i], pts_unit="sec", output_format="TCHW")
        n = video.shape[0]
        if self.train:
            stride = random.uniform(max(1.0, n / (2 * self.num_frames)), max(1.0, n / self.num_frames))
            start = random.uniform(0, max(0.0, n - stride * self.num_frames))
        else:
            stride, start = max(1.0, n / self.num_frames), 0.0
        idx = [min(n - 1, int(start + k * stride)) for k in range(self.num_frames)]
        clip = self.tf(video[idx])
        clip = self.norm(clip.float() / 255.0)
        return clip.permute(1, 0, 2, 3), self.label_of(self.files[i])  # C T H W


class SignVideoClassifier(nn.Module):
    def __init__(self, num_classes=64, drop_path=0.2):
        super().__init__()
        self.net = mvit_v2_s(weights=MViT_V2_S_Weights.KINETICS400_V1, stochastic_depth_prob=drop_path)
        self.net.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(768, num_classes))

    def forward(self, x):
        return self.net(x)

    def get_param_groups(self, lr, weight_decay, layer_decay=0.75):
        num_layers = len(self.net.blocks) + 1
        groups = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if name.startswith("net.conv_proj") or name.startswith("net.pos_encoding"):
                layer = 0
            elif name.startswith("net.blocks."):
                layer = int(name.split(".")[2]) + 1
            else:
                layer = num_layers
            no_decay = p.ndim == 1 or name.endswith(".bias") or "rel_pos" in name
            key = (layer, no_decay)
            if key not in groups:
                groups[key] = {"params": [], "lr": lr * layer_decay ** (num_layers - layer),
                               "weight_decay": 0.0 if no_decay else weight_decay}
            groups[key]["params"].append(p)
        return list(groups.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--video-dir", default="/data/lsa64/all_cut")
    ap.add_argument("--val-signers", type=int, nargs="+", default=[9, 10])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 64")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=3)
    ap.add_argument("--out", default="runs/lsa64_mvit")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    files = sorted(glob.glob(os.path.join(args.video_dir, "*.mp4")))
    signer = lambda f: int(os.path.basename(f).split("_")[1])
    train_files = [f for f in files if signer(f) not in args.val_signers]
    val_files = [f for f in files if signer(f) in args.val_signers]
    train_ds, val_ds = LSA64(train_files, train=True), LSA64(val_files, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                          persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size, num_workers=8)

    model = SignVideoClassifier().to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    param_groups = model.get_param_groups(lr, args.wd)
    for g in param_groups:
        g["base_lr"] = g["lr"]
    optimizer = torch.optim.AdamW(param_groups, betas=(0.9, 0.999))
    steps_per_epoch = len(train_dl)
    total_steps, warmup_steps = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} / val {len(val_ds)} clips; val signers {args.val_signers}")
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            if step < warmup_steps:
                scale = step / warmup_steps
            else:
                scale = 0.5 * (1 + torch.cos(torch.tensor((step - warmup_steps) / (total_steps - warmup_steps) * 3.14159265)).item())
            for g in optimizer.param_groups:
                g["lr"] = g["base_lr"] * scale
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            step += 1

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, y in val_dl:
                y = y.to(device)
                correct += torch.stack([(model(x.to(device)).argmax(1) == y).sum().float(),
                                        torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} signer-independent acc {acc * 100:.2f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
