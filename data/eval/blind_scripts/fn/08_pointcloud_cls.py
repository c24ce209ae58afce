"""PointNet++ (SSG) classification on ModelNet40.

    torchrun --nproc_per_node=4 08_pointcloud_cls.py data.num_points=1024 model=pointnet2_ssg
"""
import glob
import logging
import os
import pickle

import hydra
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

log = logging.getLogger(__name__)


def farthest_point_sample(points, n):
    N = points.shape[0]
    centroids = np.zeros(n, dtype=np.int64)
    dist_ = np.full(N, 1e10)
    farthest = 0
    for i in range(n):
        centroids[i] = farthest
        d = np.sum((points - points[farthest]) ** 2, axis=-1)
        dist_ = np.minimum(dist_, d)
        farthest = int(np.argmax(dist_))
    return points[centroids]


def normalize(pc):
    pc = pc - pc.mean(0)
    return pc / np.max(np.linalg.norm(pc, axis=1))


class ModelNet40(Dataset):
    """Reads the .txt point files once, FPS-downsamples them and caches the result."""

    def __init__(self, root, split, num_points=1024, use_normals=False, augment=False):
        self.num_points = num_points
        self.use_normals = use_normals
        self.augment = augment
        shape_names = [l.strip() for l in open(os.path.join(root, "modelnet40_shape_names.txt"))]
        self.classes = {name: i for i, name in enumerate(shape_names)}

        cache = os.path.join(root, f"modelnet40_{split}_{num_points}pts_fps.pkl")
        if os.path.exists(cache):
            with open(cache, "rb") as f:
                self.points, self.labels = pickle.load(f)
        else:
            ids = [l.strip() for l in open(os.path.join(root, f"modelnet40_{split}.txt"))]
            self.points, self.labels = [], []
            for shape_id in tqdm(ids, desc=f"preprocess {split}"):
                cls = "_".join(shape_id.split("_")[:-1])
                pts = np.loadtxt(os.path.join(root, cls, shape_id + ".txt"), delimiter=",").astype(np.float32)
                self.points.append(farthest_point_sample(pts, num_points))
                self.labels.append(self.classes[cls])
            with open(cache, "wb") as f:
                pickle.dump((self.points, self.labels), f)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        pts = self.points[i].copy()
        pts[:, :3] = normalize(pts[:, :3])
        if not self.use_normals:
            pts = pts[:, :3]
        if self.augment:
            scale = np.random.uniform(0.8, 1.25, size=(1, 3)).astype(np.float32)
            shift = np.random.uniform(-0.1, 0.1, size=(1, 3)).astype(np.float32)
            pts[:, :3] = pts[:, :3] * scale + shift
            np.random.shuffle(pts)
        return torch.from_numpy(pts), self.labels[i]


def smooth_ce(pred, target, eps=0.2):
    n = pred.size(1)
    one_hot = torch.zeros_like(pred).scatter(1, target.view(-1, 1), 1)
    one_hot = one_hot * (1 - eps) + (1 - one_hot) * eps / (n - 1)
    return -(one_hot * F.log_softmax(pred, dim=1)).sum(1).mean()


@torch.no_grad()
def evaluate(model, loader, device, num_classes=40):
    model.eval()
    correct = torch.zeros(num_classes, device=device)
    total = torch.zeros(num_classes, device=device)
    for pts, y in loader:
        pts, y = pts.to(device), y.to(device)
        pred = model(pts.transpose(1, 2)).argmax(1)
        total += torch.bincount(y, minlength=num_classes).float()
        correct += torch.bincount(y[pred == y], minlength=num_classes).float()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    oa = (correct.sum() / total.sum()).item()
    macc = (correct / total.clamp(min=1)).mean().item()
    return oa, macc


@hydra.main(version_base=None, config_path="config", config_name="cls")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed + rank)
    out_dir = HydraConfig.get().runtime.output_dir

    root = to_absolute_path(cfg.data.root)
    train_set = ModelNet40(root, "train", cfg.data.num_points, cfg.data.use_normals, augment=True)
    test_set = ModelNet40(root, "test", cfg.data.num_points, cfg.data.use_normals, augment=False)
    if rank == 0:
        log.info("train %d / test %d shapes", len(train_set), len(test_set))

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, drop_last=True, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=cfg.train.batch_size, sampler=test_sampler,
                             num_workers=cfg.data.workers, pin_memory=True)

    model = instantiate(cfg.model, num_class=40, normal_channel=cfg.data.use_normals)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = instantiate(cfg.optimizer, params=model.parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.train.epochs,
                                                           eta_min=cfg.train.min_lr)

    best_oa = 0.0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_meter = torch.zeros(2, device=device)
        for pts, y in train_loader:
            pts, y = pts.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(pts.transpose(1, 2))
            loss = smooth_ce(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_meter[0] += loss.detach() * y.size(0)
            loss_meter[1] += y.size(0)
        scheduler.step()
        dist.all_reduce(loss_meter)

        oa, macc = evaluate(model, test_loader, device)
        if rank == 0:
            log.info("epoch %d train_loss %.4f test OA %.4f mAcc %.4f",
                     epoch, (loss_meter[0] / loss_meter[1]).item(), oa, macc)
            if oa > best_oa:
                best_oa = oa
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "oa": oa,
                            "config": OmegaConf.to_container(cfg, resolve=True)},
                           os.path.join(out_dir, "best_model.pth"))
        best_oa = max(best_oa, oa)

    if rank == 0:
        log.info("best OA %.4f", best_oa)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
