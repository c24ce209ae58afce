"""RetinaNet trainer on COCO-format data, condensed from our mmdet-style codebase.

Launch:
    torchrun --nproc_per_node=4 tools/train_retinanet.py --cfg configs/retina_r50_1x.py
"""
import argparse
import json
import logging
import os
import os.path as osp
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision
from torchvision.transforms import functional as TF

logger = logging.getLogger("retina")


# --------------------------------------------------------------------------- registry
class Registry:
    def __init__(self, name):
        self.name = name
        self._modules = {}

    def register(self, cls=None, name=None):
        def _register(c):
            self._modules[name or c.__name__] = c
            return c
        return _register(cls) if cls is not None else _register

    def build(self, cfg, **kwargs):
        cfg = dict(cfg)
        obj_type = cfg.pop("type")
        return self._modules[obj_type](**cfg, **kwargs)


MODELS = Registry("models")
HOOKS = Registry("hooks")


@MODELS.register(name="RetinaNetR50FPN")
def build_retinanet(num_classes, pretrained_backbone=True):
    weights_backbone = "IMAGENET1K_V1" if pretrained_backbone else None
    return torchvision.models.detection.retinanet_resnet50_fpn(
        weights=None, weights_backbone=weights_backbone, num_classes=num_classes)


# --------------------------------------------------------------------------- data
class CocoDetection(Dataset):
    def __init__(self, img_dir, ann_file, train=True):
        with open(ann_file) as f:
            coco = json.load(f)
        self.img_dir = img_dir
        self.train = train
        self.images = sorted(coco["images"], key=lambda x: x["id"])
        self.cat_ids = sorted(c["id"] for c in coco["categories"])
        self.cat2label = {c: i for i, c in enumerate(self.cat_ids)}
        self.anns = {}
        for a in coco["annotations"]:
            if a.get("iscrowd", 0):
                continue
            self.anns.setdefault(a["image_id"], []).append(a)
        if train:
            self.images = [im for im in self.images if im["id"] in self.anns]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, idx):
        info = self.images[idx]
        img = Image.open(osp.join(self.img_dir, info["file_name"])).convert("RGB")
        boxes, labels = [], []
        for a in self.anns.get(info["id"], []):
            x, y, w, h = a["bbox"]
            if w < 1 or h < 1:
                continue
            boxes.append([x, y, x + w, y + h])
            labels.append(self.cat2label[a["category_id"]])
        boxes = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        labels = torch.as_tensor(labels, dtype=torch.int64)
        img = TF.to_tensor(img)
        if self.train and torch.rand(1).item() < 0.5:
            img = img.flip(-1)
            w = img.shape[-1]
            boxes[:, [0, 2]] = w - boxes[:, [2, 0]]
        return img, {"boxes": boxes, "labels": labels, "image_id": info["id"]}


def collate(batch):
    return tuple(zip(*batch))


class InferenceSampler(torch.utils.data.Sampler):
    """Shards the val set without padding, so no image is evaluated twice."""

    def __init__(self, size, rank, world_size):
        self._local_indices = list(range(size))[rank::world_size]

    def __iter__(self):
        return iter(self._local_indices)

    def __len__(self):
        return len(self._local_indices)


# --------------------------------------------------------------------------- hooks
class Hook:
    def after_iter(self, runner):
        pass

    def after_epoch(self, runner):
        pass


@HOOKS.register()
class LoggerHook(Hook):
    def __init__(self, interval=50):
        self.interval = interval

    def after_iter(self, runner):
        if runner.iter % self.interval == 0 and runner.rank == 0:
            msg = ", ".join(f"{k}: {v:.4f}" for k, v in runner.log_vars.items())
            logger.info(f"epoch {runner.epoch} iter {runner.iter} lr {runner.lr:.5f} {msg}")


@HOOKS.register()
class CheckpointHook(Hook):
    def __init__(self, interval=1):
        self.interval = interval

    def after_epoch(self, runner):
        if (runner.epoch + 1) % self.interval:
            return
        if runner.rank == 0:
            torch.save({"epoch": runner.epoch,
                        "state_dict": runner.model.module.state_dict(),
                        "optimizer": runner.optimizer.state_dict()},
                       osp.join(runner.work_dir, f"epoch_{runner.epoch + 1}.pth"))
        dist.barrier()


# --------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, loader, dataset, device, rank, world_size, work_dir):
    model.eval()
    local_dets = []
    for images, targets in loader:
        images = [im.to(device, non_blocking=True) for im in images]
        outputs = model(images)
        for out, tgt in zip(outputs, targets):
            n = out["boxes"].shape[0]
            img_id = torch.full((n, 1), tgt["image_id"], dtype=torch.float32, device=device)
            local_dets.append(torch.cat([img_id, out["boxes"], out["scores"][:, None],
                                         out["labels"][:, None].float()], dim=1))
    dets = torch.cat(local_dets, dim=0) if local_dets else torch.zeros((0, 7), device=device)

    gathered = [torch.zeros_like(dets) for _ in range(world_size)]
    dist.all_gather(gathered, dets)

    if rank != 0:
        return None
    all_dets = torch.cat(gathered).cpu().tolist()
    results = []
    for img_id, x1, y1, x2, y2, score, label in all_dets:
        results.append({"image_id": int(img_id),
                        "category_id": dataset.cat_ids[int(label)],
                        "bbox": [x1, y1, x2 - x1, y2 - y1],
                        "score": score})
    res_file = osp.join(work_dir, "bbox_results.json")
    with open(res_file, "w") as f:
        json.dump(results, f)
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    gt = COCO(dataset.ann_file)
    dt = gt.loadRes(res_file) if results else COCO()
    coco_eval = COCOeval(gt, dt, "bbox")
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return coco_eval.stats[0]


# --------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, cfg, model, optimizer, scheduler, hooks, work_dir, rank):
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.hooks = hooks
        self.work_dir = work_dir
        self.rank = rank
        self.epoch = 0
        self.iter = 0
        self.log_vars = {}
        self.scaler = torch.cuda.amp.GradScaler(enabled=cfg["fp16"])

    @property
    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    def train_epoch(self, loader, device):
        self.model.train()
        for images, targets in loader:
            images = [im.to(device, non_blocking=True) for im in images]
            targets = [{"boxes": t["boxes"].to(device), "labels": t["labels"].to(device)}
                       for t in targets]
            with torch.autocast("cuda", enabled=self.cfg["fp16"]):
                loss_dict = self.model(images, targets)
                loss = sum(loss_dict.values())
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"])
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()

            reduced = torch.stack([v.detach() for v in loss_dict.values()])
            dist.all_reduce(reduced)
            reduced /= dist.get_world_size()
            self.log_vars = {k: v.item() for k, v in zip(loss_dict.keys(), reduced)}
            self.iter += 1
            for h in self.hooks:
                h.after_iter(self)


def load_cfg(path):
    ns = {}
    with open(path) as f:
        exec(f.read(), ns)
    return ns["cfg"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--work-dir", default="work_dirs/retina_r50_1x")
    args = parser.parse_args()
    cfg = load_cfg(args.cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN)
    os.makedirs(args.work_dir, exist_ok=True)

    train_set = CocoDetection(cfg["data_root"] + "/train2017", cfg["data_root"] + "/annotations/instances_train2017.json")
    val_set = CocoDetection(cfg["data_root"] + "/val2017", cfg["data_root"] + "/annotations/instances_val2017.json", train=False)
    val_set.ann_file = cfg["data_root"] + "/annotations/instances_val2017.json"
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = InferenceSampler(len(val_set), rank, world_size)
    train_loader = DataLoader(train_set, batch_size=cfg["samples_per_gpu"], sampler=train_sampler,
                              num_workers=cfg["workers_per_gpu"], collate_fn=collate, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler,
                            num_workers=cfg["workers_per_gpu"], collate_fn=collate)

    model = MODELS.build(cfg["model"]).to(device)
    model = DDP(model, device_ids=[local_rank])

    # linear scaling rule, base lr given for 16 images per iteration
    lr = cfg["lr"] * cfg["samples_per_gpu"] * world_size / 16
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    total_iters = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[int(total_iters * 0.67), int(total_iters * 0.89)], gamma=0.1)
    hooks = [HOOKS.build(h) for h in cfg["hooks"]]
    runner = Runner(cfg, model, optimizer, scheduler, hooks, args.work_dir, rank)

    for epoch in range(cfg["epochs"]):
        runner.epoch = epoch
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        runner.train_epoch(train_loader, device)
        for h in hooks:
            h.after_epoch(runner)
        bbox_map = evaluate(model, val_loader, val_set, device, rank, world_size, args.work_dir)
        if rank == 0:
            logger.info(f"epoch {epoch} done in {time.time() - t0:.0f}s, bbox mAP {bbox_map:.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
