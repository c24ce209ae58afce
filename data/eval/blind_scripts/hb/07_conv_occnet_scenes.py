"""Convolutional occupancy network (tri-plane variant) on synthetic rooms, with HF Accelerate.

accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 07_conv_occnet_scenes.py \
    --data_root data/synthetic_room --output_dir runs/convonet_room
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

logger = get_logger(__name__)


def build_index(root, split, index_file):
    """Scan the room folders once and write a flat index of (room, chunk) pairs."""
    entries = []
    for room in sorted(os.listdir(root)):
        d = os.path.join(root, room)
        lst = os.path.join(d, f"{split}.lst")
        if not os.path.isfile(lst):
            continue
        with open(lst) as f:
            entries += [f"{room}/{l.strip()}" for l in f if l.strip()]
    tmp = index_file + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(entries))
    os.replace(tmp, index_file)


class RoomChunks(Dataset):
    def __init__(self, root, index_file, n_in=10000, n_query=4096):
        with open(index_file) as f:
            self.items = f.read().split()
        self.root, self.n_in, self.n_query = root, n_in, n_query

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = os.path.join(self.root, self.items[i])
        pc = np.load(os.path.join(d, "pointcloud.npz"))["points"]
        pts = np.load(os.path.join(d, "points_iou.npz"))
        qp, occ = pts["points"], np.unpackbits(pts["occupancies"])[: len(pts["points"])]
        a = np.random.randint(len(pc), size=self.n_in)
        b = np.random.randint(len(qp), size=self.n_query)
        inp = pc[a] + 0.005 * np.random.randn(self.n_in, 3)
        return (torch.from_numpy(inp).float(), torch.from_numpy(qp[b]).float(),
                torch.from_numpy(occ[b]).float())


class TriplaneEncoder(nn.Module):
    def __init__(self, c_dim=32, reso=128, padding=0.1):
        super().__init__()
        self.reso, self.padding, self.c_dim = reso, padding, c_dim
        self.point_mlp = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(),
                                       nn.Linear(128, c_dim))
        self.unet = nn.Sequential(
            nn.Conv2d(c_dim, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, c_dim, 3, padding=1),
        )

    def normalize(self, p):
        return ((p / (1 + self.padding + 1e-3)) + 0.5).clamp(0, 1 - 1e-5)

    def plane_feature(self, p, f, axes):
        B, N, C = f.shape
        xy = self.normalize(p[..., axes])
        idx = (xy * self.reso).long()
        idx = idx[..., 0] + self.reso * idx[..., 1]
        plane = f.new_zeros(B, self.reso * self.reso, C)
        cnt = f.new_zeros(B, self.reso * self.reso, 1)
        plane.scatter_add_(1, idx[..., None].expand(-1, -1, C), f)
        cnt.scatter_add_(1, idx[..., None], torch.ones_like(f[..., :1]))
        plane = (plane / cnt.clamp(min=1)).transpose(1, 2).reshape(B, C, self.reso, self.reso)
        return self.unet(plane)

    def forward(self, p):
        f = self.point_mlp(p)
        return {k: self.plane_feature(p, f, ax) for k, ax in (("xz", [0, 2]), ("xy", [0, 1]), ("yz", [1, 2]))}


class PlaneDecoder(nn.Module):
    def __init__(self, c_dim=32, hidden=32, n_blocks=5, padding=0.1):
        super().__init__()
        self.padding = padding
        self.fc_p = nn.Linear(3, hidden)
        self.fc_c = nn.ModuleList([nn.Linear(c_dim, hidden) for _ in range(n_blocks)])
        self.blocks = nn.ModuleList([nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                                   nn.Linear(hidden, hidden)) for _ in range(n_blocks)])
        self.fc_out = nn.Linear(hidden, 1)

    def sample(self, p, plane, axes):
        xy = ((p[..., axes] / (1 + self.padding + 1e-3)) + 0.5).clamp(0, 1 - 1e-5)
        grid = (2.0 * xy - 1.0)[:, :, None]
        return F.grid_sample(plane, grid, align_corners=True, mode="bilinear").squeeze(-1).transpose(1, 2)

    def forward(self, p, planes):
        c = (self.sample(p, planes["xz"], [0, 2]) + self.sample(p, planes["xy"], [0, 1])
             + self.sample(p, planes["yz"], [1, 2]))
        net = self.fc_p(p)
        for fc_c, blk in zip(self.fc_c, self.blocks):
            net = net + fc_c(c)
            net = net + blk(net)
        return self.fc_out(F.relu(net)).squeeze(-1)


class ConvONet(nn.Module):
    def __init__(self, c_dim=32, reso=128):
        super().__init__()
        self.encoder = TriplaneEncoder(c_dim, reso)
        self.decoder = PlaneDecoder(c_dim)

    def forward(self, points, inputs):
        return self.decoder(points, self.encoder(inputs))

    @torch.no_grad()
    def predict_occupancy(self, points, inputs, chunk=100000):
        planes = self.encoder(inputs)
        return torch.cat([torch.sigmoid(self.decoder(p, planes)) for p in points.split(chunk, dim=1)], 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--output_dir", default="runs/convonet_room")
    p.add_argument("--train_batch_size", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max_steps", type=int, default=200000)
    p.add_argument("--eval_steps", type=int, default=5000)
    p.add_argument("--checkpoint_steps", type=int, default=5000)
    p.add_argument("--resume_from", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=args.output_dir,
                                            logging_dir=os.path.join(args.output_dir, "logs")),
    )
    set_seed(args.seed, device_specific=True)
    accelerator.init_trackers("convonet_room", config=vars(args))

    index = {s: os.path.join(args.data_root, f"index_{s}.txt") for s in ("train", "val")}
    with accelerator.main_process_first():
        for split, path in index.items():
            if not os.path.exists(path):
                build_index(args.data_root, split, path)

    train_ds = RoomChunks(args.data_root, index["train"])
    val_ds = RoomChunks(args.data_root, index["val"], n_query=100000)
    train_dl = DataLoader(train_ds, batch_size=args.train_batch_size, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=4, shuffle=False, num_workers=4)

    model = ConvONet()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)

    global_step = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        global_step = int(args.resume_from.rstrip("/").split("_")[-1])
        logger.info(f"resumed at step {global_step}")

    steps_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    start_epoch = global_step // steps_per_epoch
    progress = tqdm(total=args.max_steps, initial=global_step, disable=not accelerator.is_local_main_process)

    for epoch in range(start_epoch, 10 ** 6):
        if hasattr(train_dl, "set_epoch"):
            train_dl.set_epoch(epoch)
        model.train()
        for inputs, points, occ in train_dl:
            with accelerator.accumulate(model):
                logits = model(points, inputs)
                loss = F.binary_cross_entropy_with_logits(logits.float(), occ, reduction="none").sum(-1).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

            if not accelerator.sync_gradients:
                continue
            global_step += 1
            progress.update(1)
            if global_step % 100 == 0:
                avg = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.log({"train/loss": avg}, step=global_step)

            if global_step % args.checkpoint_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"checkpoint_{global_step}"))

            if global_step % args.eval_steps == 0:
                model.eval()
                ious = []
                net = accelerator.unwrap_model(model)
                for v_inputs, v_points, v_occ in val_dl:
                    prob = net.predict_occupancy(v_points, v_inputs)
                    pred, gt = prob > 0.5, v_occ > 0.5
                    iou = (pred & gt).sum(-1).float() / (pred | gt).sum(-1).float().clamp(min=1)
                    ious.append(accelerator.gather_for_metrics(iou))
                val_iou = torch.cat(ious).mean().item()
                accelerator.log({"val/iou": val_iou}, step=global_step)
                logger.info(f"step {global_step}: val IoU {val_iou:.4f}")
                model.train()

            if global_step >= args.max_steps:
                break
        if global_step >= args.max_steps:
            break

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model_final.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
