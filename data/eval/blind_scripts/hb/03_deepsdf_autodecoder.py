#!/usr/bin/env python
# DeepSDF-style auto-decoder, multi-GPU.
#   torchrun --nproc_per_node=4 03_deepsdf_autodecoder.py -e experiments/chairs --resume
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_instance_filenames(data_source, split):
    files = []
    for dataset in split:
        for class_name in split[dataset]:
            for instance in split[dataset][class_name]:
                f = os.path.join(dataset, class_name, instance + ".npz")
                if os.path.isfile(os.path.join(data_source, "SdfSamples", f)):
                    files.append(f)
                else:
                    logging.warning("missing %s", f)
    return files


class SDFSamples(Dataset):
    def __init__(self, data_source, split, subsample):
        self.data_source = data_source
        self.subsample = subsample
        self.npyfiles = get_instance_filenames(data_source, split)

    def __len__(self):
        return len(self.npyfiles)

    def __getitem__(self, idx):
        fn = os.path.join(self.data_source, "SdfSamples", self.npyfiles[idx])
        npz = np.load(fn)
        pos = torch.from_numpy(npz["pos"]).float()
        neg = torch.from_numpy(npz["neg"]).float()
        half = self.subsample // 2
        pos = pos[torch.randint(0, pos.shape[0], (half,))]
        neg = neg[torch.randint(0, neg.shape[0], (half,))]
        return torch.cat([pos, neg], 0), idx


class Decoder(nn.Module):
    def __init__(self, latent_size, dims=(512,) * 8, latent_in=(4,), dropout_prob=0.2):
        super().__init__()
        dims = [latent_size + 3] + list(dims) + [1]
        self.latent_in = latent_in
        self.num_layers = len(dims)
        self.layers = nn.ModuleList()
        for l in range(self.num_layers - 1):
            out_dim = dims[l + 1] - dims[0] if (l + 1) in latent_in else dims[l + 1]
            self.layers.append(nn.utils.weight_norm(nn.Linear(dims[l], out_dim)))
        self.dropout_prob = dropout_prob

    def forward(self, x_in):
        x = x_in
        for l, lin in enumerate(self.layers):
            if l in self.latent_in:
                x = torch.cat([x, x_in], 1)
            x = lin(x)
            if l < self.num_layers - 2:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout_prob, training=self.training)
        return torch.tanh(x)


class AutoDecoder(nn.Module):
    """Decoder plus one latent code per training shape."""

    def __init__(self, num_scenes, latent_size, code_init_std):
        super().__init__()
        self.decoder = Decoder(latent_size)
        self.lat_vecs = nn.Embedding(num_scenes, latent_size, max_norm=1.0)
        nn.init.normal_(self.lat_vecs.weight, 0.0, code_init_std)

    def forward(self, indices, xyz):
        codes = self.lat_vecs(indices)
        return self.decoder(torch.cat([codes, xyz], 1)), codes


class StepLearningRateSchedule:
    def __init__(self, initial, interval, factor):
        self.initial, self.interval, self.factor = initial, interval, factor

    def get(self, epoch):
        return self.initial * (self.factor ** (epoch // self.interval))


def save_checkpoint(path, model, optimizer, epoch):
    torch.save({"epoch": epoch, "model_state_dict": model.module.state_dict(),
                "optimizer_state_dict": optimizer.state_dict()}, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--experiment", "-e", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()

    with open(os.path.join(args.experiment, "specs.json")) as f:
        specs = json.load(f)
    with open(specs["TrainSplit"]) as f:
        train_split = json.load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    latent_size = specs["CodeLength"]
    scenes_per_batch = specs["ScenesPerBatch"]
    clamp_dist = specs["ClampingDistance"]
    code_reg_lambda = specs.get("CodeRegularizationLambda", 1e-4)
    num_epochs = specs["NumEpochs"]
    ckpt_dir = os.path.join(args.experiment, "ModelParameters")

    sdf_dataset = SDFSamples(specs["DataSource"], train_split, specs["SamplesPerScene"])
    sampler = DistributedSampler(sdf_dataset, shuffle=True)
    loader = DataLoader(sdf_dataset, batch_size=scenes_per_batch // world_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    logging.info("%d shapes, %d per GPU batch", len(sdf_dataset), scenes_per_batch // world_size)

    model = AutoDecoder(len(sdf_dataset), latent_size, specs.get("CodeInitStdDev", 1.0) / latent_size ** 0.5)
    model = DistributedDataParallel(model.to(device), device_ids=[local_rank])

    dec_sched = StepLearningRateSchedule(specs["LearningRateDecoder"], 500, 0.5)
    lat_sched = StepLearningRateSchedule(specs["LearningRateLatent"], 500, 0.5)
    optimizer = torch.optim.Adam([
        {"params": model.module.decoder.parameters(), "lr": dec_sched.get(0)},
        {"params": model.module.lat_vecs.parameters(), "lr": lat_sched.get(0)},
    ])

    start_epoch = 1
    if args.resume:
        ckpt = torch.load(os.path.join(ckpt_dir, "latest.pth"))
        model.module.load_state_dict(ckpt["model_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
        start_epoch = ckpt["epoch"] + 1
        logging.info("resumed from epoch %d", ckpt["epoch"])
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    loss_l1 = nn.L1Loss(reduction="sum")
    for epoch in range(start_epoch, num_epochs + 1):
        start = time.time()
        sampler.set_epoch(epoch)
        model.train()
        optimizer.param_groups[0]["lr"] = dec_sched.get(epoch)
        optimizer.param_groups[1]["lr"] = lat_sched.get(epoch)

        epoch_loss = torch.zeros(1, device=device)
        n_batches = 0
        for sdf_data, indices in loader:
            sdf_data = sdf_data.to(device, non_blocking=True).reshape(-1, 4)
            num_sdf = sdf_data.shape[0]
            xyz = sdf_data[:, :3]
            sdf_gt = torch.clamp(sdf_data[:, 3:4], -clamp_dist, clamp_dist)
            indices = indices.to(device).unsqueeze(-1).repeat(1, specs["SamplesPerScene"]).view(-1)

            optimizer.zero_grad(set_to_none=True)
            pred_sdf, codes = model(indices, xyz)
            pred_sdf = torch.clamp(pred_sdf, -clamp_dist, clamp_dist)
            loss = loss_l1(pred_sdf, sdf_gt) / num_sdf
            reg = code_reg_lambda * min(1, epoch / 100) * codes.norm(dim=1).sum() / num_sdf
            (loss + reg).backward()
            optimizer.step()

            epoch_loss += loss.detach()
            n_batches += 1

        dist.all_reduce(epoch_loss)
        epoch_loss /= (world_size * max(n_batches, 1))
        logging.info("epoch %d loss %.6f time %.1fs", epoch, epoch_loss.item(), time.time() - start)

        if rank == 0:
            if epoch % specs.get("SnapshotFrequency", 100) == 0:
                save_checkpoint(os.path.join(ckpt_dir, f"{epoch}.pth"), model, optimizer, epoch)
            save_checkpoint(os.path.join(ckpt_dir, "latest.pth"), model, optimizer, epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
