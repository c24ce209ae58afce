"""nnU-Net-style training of a PlainConvUNet on our preprocessed abdominal CT
(organs-at-risk for radiotherapy planning), DDP version.

Input: nnU-Net preprocessed folder (one .npz per case with 'data' and 'seg',
       plus a .pkl with properties), splits_final.json for the 5 folds.

    torchrun --standalone --nproc_per_node=4 09_nnunet_style_plainconv.py -f 2
"""
import argparse
import json
import os
import pickle
from time import time

import numpy as np
import torch
import torch.distributed as dist
from dynamic_network_architectures.architectures.unet import PlainConvUNet
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss

PATCH = (112, 160, 128)
NUM_CLASSES = 9  # background + 8 OARs


class PatchDataset(Dataset):
    """Random patches from preprocessed cases, 1/3 of them centred on foreground."""

    def __init__(self, folder, case_ids, patch_size, oversample_fg=0.33, samples_per_case=4):
        self.folder = folder
        self.case_ids = list(case_ids)
        self.patch = np.array(patch_size)
        self.oversample_fg = oversample_fg
        self.samples_per_case = samples_per_case

    def __len__(self):
        return len(self.case_ids) * self.samples_per_case

    def _load(self, cid):
        arr = np.load(os.path.join(self.folder, f"{cid}.npz"))
        with open(os.path.join(self.folder, f"{cid}.pkl"), "rb") as f:
            props = pickle.load(f)
        return arr["data"], arr["seg"], props

    def __getitem__(self, idx):
        cid = self.case_ids[idx // self.samples_per_case]
        data, seg, props = self._load(cid)
        shape = np.array(data.shape[1:])
        pad = np.maximum(self.patch - shape, 0)
        if pad.any():
            pw = [(0, 0)] + [(p // 2, p - p // 2) for p in pad]
            data = np.pad(data, pw, mode="constant")
            seg = np.pad(seg, pw, mode="constant", constant_values=0)
            shape = np.array(data.shape[1:])
        fg = props.get("class_locations", {})
        classes = [c for c in fg if len(fg[c]) > 0]
        if classes and np.random.rand() < self.oversample_fg:
            loc = fg[classes[np.random.randint(len(classes))]]
            centre = loc[np.random.randint(len(loc))][1:]
            lo = np.clip(np.array(centre) - self.patch // 2, 0, shape - self.patch)
        else:
            lo = np.array([np.random.randint(0, s - p + 1) for s, p in zip(shape, self.patch)])
        sl = tuple(slice(l, l + p) for l, p in zip(lo, self.patch))
        x = data[(slice(None),) + sl].astype(np.float32)
        y = seg[(slice(None),) + sl].astype(np.int64)
        y[y < 0] = 0
        for ax in range(3):
            if np.random.rand() < 0.5:
                x = np.flip(x, ax + 1)
                y = np.flip(y, ax + 1)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


class CaseDataset(Dataset):
    def __init__(self, folder, case_ids):
        self.folder, self.case_ids = folder, list(case_ids)

    def __len__(self):
        return len(self.case_ids)

    def __getitem__(self, i):
        arr = np.load(os.path.join(self.folder, f"{self.case_ids[i]}.npz"))
        seg = arr["seg"].astype(np.int64)
        seg[seg < 0] = 0
        return torch.from_numpy(arr["data"].astype(np.float32)), torch.from_numpy(seg)


def build_network():
    return PlainConvUNet(
        input_channels=1, n_stages=6,
        features_per_stage=[32, 64, 128, 256, 320, 320],
        conv_op=nn.Conv3d, kernel_sizes=[[3, 3, 3]] * 6,
        strides=[[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2], [2, 2, 2], [1, 2, 2]],
        n_conv_per_stage=[2] * 6, num_classes=NUM_CLASSES, n_conv_per_stage_decoder=[2] * 5,
        conv_bias=True, norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True},
        nonlin=nn.LeakyReLU, nonlin_kwargs={"inplace": True}, deep_supervision=True,
    )


def ds_targets(seg, n_out):
    # nearest-neighbour downsampled targets for the deep supervision outputs
    tgts = [seg]
    for _ in range(n_out - 1):
        tgts.append(nn.functional.interpolate(tgts[-1].float(), scale_factor=0.5, mode="nearest").long())
    return tgts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-f", "--fold", type=int, default=0)
    ap.add_argument("--preprocessed", default="/data/nnUNet_preprocessed/Dataset117_OAR/nnUNetPlans_3d_fullres")
    ap.add_argument("--splits", default="/data/nnUNet_preprocessed/Dataset117_OAR/splits_final.json")
    ap.add_argument("--out", default="/data/results/Dataset117_OAR/plainconv_ddp")
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--initial_lr", type=float, default=1e-2)
    ap.add_argument("--val_every", type=int, default=50)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join(args.out, f"fold_{args.fold}")

    with open(args.splits) as f:
        split = json.load(f)[args.fold]
    train_ds = PatchDataset(args.preprocessed, split["train"], PATCH)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, persistent_workers=True,
                        worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + w) % 2 ** 32))
    val_ids = split["val"][rank::world]
    val_loader = DataLoader(CaseDataset(args.preprocessed, val_ids), batch_size=1, num_workers=2)

    network = build_network().to(device)
    model = DDP(network, device_ids=[local_rank])
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, batch=True, smooth_nr=1e-5, smooth_dr=1e-5)
    ds_w = np.array([1 / 2 ** i for i in range(5)])
    ds_w = ds_w / ds_w.sum()
    optimizer = torch.optim.SGD(model.parameters(), args.initial_lr, momentum=0.99, nesterov=True,
                                weight_decay=3e-5)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    best_dice = 0.0

    for epoch in range(args.epochs):
        lr = args.initial_lr * (1 - epoch / args.epochs) ** 0.9
        for g in optimizer.param_groups:
            g["lr"] = lr
        sampler.set_epoch(epoch)
        model.train()
        start = time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", enabled=True):
                outs = model(x)
                tgts = ds_targets(y, len(outs))
                loss = sum(w * loss_fn(o, t) for w, o, t in zip(ds_w, outs, tgts))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 12)
            scaler.step(optimizer)
            scaler.update()
            loss_sum[0] += loss.detach().float()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)
        if rank == 0:
            train_loss = (loss_sum[0] / loss_sum[1]).item()
            print(f"epoch {epoch}: train_loss {train_loss:.4f} lr {lr:.5f} ({time() - start:.0f}s)", flush=True)

        if (epoch + 1) % args.val_every == 0:
            model.decoder.deep_supervision = False
            model.eval()
            tp = torch.zeros(NUM_CLASSES - 1, device=device)
            fp = torch.zeros_like(tp)
            fn = torch.zeros_like(tp)
            with torch.no_grad(), torch.autocast("cuda", enabled=True):
                for x, y in val_loader:
                    x, y = x.to(device), y.to(device)
                    pred = sliding_window_inference(x, PATCH, 2, model, overlap=0.5, mode="gaussian").argmax(1)
                    for c in range(1, NUM_CLASSES):
                        p, g = pred == c, y[:, 0] == c
                        tp[c - 1] += (p & g).sum()
                        fp[c - 1] += (p & ~g).sum()
                        fn[c - 1] += (~p & g).sum()
            for t in (tp, fp, fn):
                dist.all_reduce(t)
            dice = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).cpu().numpy()
            model.decoder.deep_supervision = True
            if rank == 0:
                print(f"  pseudo dice per class {np.round(dice, 4).tolist()} mean {dice.mean():.4f}", flush=True)
                torch.save({"network_weights": network.state_dict(), "optimizer_state": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(out_dir, "checkpoint_latest.pth"))
                if dice.mean() > best_dice:
                    best_dice = dice.mean()
                    torch.save({"network_weights": network.state_dict(), "epoch": epoch},
                               os.path.join(out_dir, "checkpoint_best.pth"))
            dist.barrier()

    if rank == 0:
        torch.save({"network_weights": network.state_dict(), "epoch": args.epochs},
                   os.path.join(out_dir, "checkpoint_final.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
