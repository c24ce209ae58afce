"""DeepSDF auto-decoder: one latent code per training shape + shared SDF MLP.

SDF samples are preprocessed into npz files (pos / neg, [N, 4] = xyz + sdf),
as produced by the DeepSDF preprocessing. Multi-GPU with DDP:

    torchrun --nproc_per_node=4 07_deepsdf_autodecoder.py --specs experiments/chairs/specs.json
"""
import argparse
import json
import logging
import os

import numpy as np
import plyfile
import skimage.measure
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("deepsdf")


class SDFSamples(Dataset):
    def __init__(self, data_dir, split_file, n_samples):
        with open(split_file) as f:
            split = json.load(f)
        self.files = []
        for dataset, classes in split.items():
            for cls, instances in classes.items():
                self.files += [os.path.join(data_dir, "SdfSamples", dataset, cls, i + ".npz") for i in instances]
        self.n = n_samples

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        npz = np.load(self.files[idx])
        pos, neg = npz["pos"], npz["neg"]
        half = self.n // 2
        pos = pos[np.random.randint(0, pos.shape[0], half)]
        neg = neg[np.random.randint(0, neg.shape[0], half)]
        s = torch.from_numpy(np.concatenate([pos, neg]).astype(np.float32))
        return s, idx


class Decoder(nn.Module):
    def __init__(self, latent_size, dims=(512,) * 8, latent_in=(4,), dropout_p=0.2):
        super().__init__()
        dims = [latent_size + 3] + list(dims) + [1]
        self.latent_in = latent_in
        self.layers = nn.ModuleList()
        for l in range(len(dims) - 1):
            out_dim = dims[l + 1] - dims[0] if (l + 1) in latent_in else dims[l + 1]
            lin = nn.Linear(dims[l], out_dim)
            self.layers.append(nn.utils.weight_norm(lin) if l < len(dims) - 2 else lin)
        self.dropout_p = dropout_p

    def forward(self, x):
        inp = x
        for l, lin in enumerate(self.layers):
            if l in self.latent_in:
                x = torch.cat([x, inp], -1)
            x = lin(x)
            if l < len(self.layers) - 1:
                x = F.relu(x)
                x = F.dropout(x, self.dropout_p, self.training)
        return torch.tanh(x)


class AutoDecoder(nn.Module):
    def __init__(self, num_shapes, latent_size, code_std):
        super().__init__()
        self.latents = nn.Embedding(num_shapes, latent_size)
        nn.init.normal_(self.latents.weight, 0.0, code_std)
        self.decoder = Decoder(latent_size)

    def decode(self, z, xyz):
        return self.decoder(torch.cat([z.expand(xyz.shape[0], -1), xyz], -1))

    def forward(self, idx, xyz):
        # idx [B], xyz [B, S, 3]
        z = self.latents(idx)[:, None].expand(-1, xyz.shape[1], -1)
        return self.decoder(torch.cat([z, xyz], -1)).squeeze(-1), z


@torch.no_grad()
def write_mesh(sdf_fn, z, path, N=256, max_batch=2 ** 18):
    lin = torch.linspace(-1, 1, N, device=z.device)
    grid = torch.stack(torch.meshgrid(lin, lin, lin, indexing="ij"), -1).reshape(-1, 3)
    vals = torch.cat([sdf_fn(z, grid[s:s + max_batch]).squeeze(-1) for s in range(0, grid.shape[0], max_batch)])
    vol = vals.reshape(N, N, N).cpu().numpy()
    if vol.min() > 0 or vol.max() < 0:
        return False
    verts, faces, _, _ = skimage.measure.marching_cubes(vol, 0.0, spacing=[2.0 / (N - 1)] * 3)
    verts = verts - 1.0
    v = np.array([tuple(p) for p in verts], dtype=[("x", "f4"), ("y", "f4"), ("z", "f4")])
    f = np.array([(list(t),) for t in faces], dtype=[("vertex_indices", "i4", (3,))])
    plyfile.PlyData([plyfile.PlyElement.describe(v, "vertex"), plyfile.PlyElement.describe(f, "face")]).write(path)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.specs) as f:
        specs = json.load(f)
    exp_dir = os.path.dirname(args.specs)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    ds = SDFSamples(specs["DataSource"], specs["TrainSplit"], specs["SamplesPerScene"])
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=specs["ScenesPerBatch"] // world, sampler=sampler,
                        num_workers=specs.get("DataLoaderThreads", 8), drop_last=True, pin_memory=True)
    log.info("%d shapes, %d per GPU batch", len(ds), specs["ScenesPerBatch"] // world)

    model = AutoDecoder(len(ds), specs["CodeLength"], specs.get("CodeInitStdDev", 1.0) / np.sqrt(specs["CodeLength"]))
    model = model.to(device)
    start_epoch = 1
    optim = torch.optim.Adam([
        {"params": model.decoder.parameters(), "lr": specs["LearningRate"]["decoder"]},
        {"params": model.latents.parameters(), "lr": specs["LearningRate"]["latent"]},
    ])
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        start_epoch = ck["epoch"] + 1
    model = DDP(model, device_ids=[local_rank])
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=500, gamma=0.5, last_epoch=start_epoch - 2)

    clamp = specs.get("ClampingDistance", 0.1)
    reg_lambda = specs.get("CodeRegularizationLambda", 1e-4)
    n_epochs = specs["NumEpochs"]
    for epoch in range(start_epoch, n_epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for samples, idx in loader:
            samples, idx = samples.to(device, non_blocking=True), idx.to(device)
            xyz, gt = samples[..., :3], samples[..., 3]
            pred, z = model(idx, xyz)
            l1 = F.l1_loss(pred, gt.clamp(-clamp, clamp))
            reg = reg_lambda * min(1.0, epoch / 100) * z[:, 0].pow(2).sum(-1).mean()
            loss = l1 + reg
            optim.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), specs.get("GradientClipNorm", 1.0))
            optim.step()
            tot += torch.stack([l1.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        log.info("epoch %d  l1 %.5f  lr %.2e", epoch, (tot[0] / tot[1]).item(), sched.get_last_lr()[0])

        if epoch % specs.get("SnapshotFrequency", 100) == 0:
            if rank == 0:
                os.makedirs(os.path.join(exp_dir, "ModelParameters"), exist_ok=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict()},
                           os.path.join(exp_dir, "ModelParameters", f"{epoch}.pth"))
                model.eval()
                mesh_dir = os.path.join(exp_dir, "TrainingMeshes", str(epoch))
                os.makedirs(mesh_dir, exist_ok=True)
                for i in range(min(8, len(ds))):
                    z = model.module.latents.weight[i:i + 1].detach()
                    write_mesh(model.decode, z, os.path.join(mesh_dir, f"{i:04d}.ply"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
