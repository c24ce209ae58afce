"""Trainer-style wrapper around the DETR repo (models/, datasets/, util/).

torchrun --nproc_per_node 8 09_detr_trainer.py --config configs/detr_r50_150e.yaml
"""
import argparse
import json
import logging
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import util.misc as utils
from datasets import build_dataset, get_coco_api_from_dataset
from datasets.coco_eval import CocoEvaluator
from models import build_model

logger = logging.getLogger("detr")

DEFAULTS = dict(
    lr=1e-4, lr_backbone=1e-5, batch_size=4, weight_decay=1e-4, epochs=150, lr_drop=100, clip_max_norm=0.1,
    frozen_weights=None, backbone="resnet50", dilation=False, position_embedding="sine",
    enc_layers=6, dec_layers=6, dim_feedforward=2048, hidden_dim=256, dropout=0.1, nheads=8,
    num_queries=100, pre_norm=False, masks=False, aux_loss=True,
    set_cost_class=1, set_cost_bbox=5, set_cost_giou=2, mask_loss_coef=1, dice_loss_coef=1,
    bbox_loss_coef=5, giou_loss_coef=2, eos_coef=0.1,
    dataset_file="coco", coco_path="/data/coco", coco_panoptic_path=None, remove_difficult=False,
    output_dir="outputs/detr", device="cuda", seed=42, num_workers=4, dist_url="env://",
)


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return SimpleNamespace(**cfg)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        utils.init_distributed_mode(cfg)
        self.device = torch.device(cfg.device)
        self.rank = utils.get_rank()
        torch.manual_seed(cfg.seed + self.rank)

        model, self.criterion, self.postprocessors = build_model(cfg)
        model.to(self.device)
        self.model_without_ddp = model
        self.model = DDP(model, device_ids=[cfg.gpu]) if cfg.distributed else model

        self.optimizer = self.build_optimizer()
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, cfg.lr_drop)
        self.build_loaders()
        self.out_dir = Path(cfg.output_dir)
        if utils.is_main_process():
            self.out_dir.mkdir(parents=True, exist_ok=True)
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                                handlers=[logging.StreamHandler(), logging.FileHandler(self.out_dir / "train.log")])
        self.start_epoch = 0

    def build_optimizer(self):
        cfg = self.cfg
        backbone_params = [p for p in self.model.backbone.parameters() if p.requires_grad]
        backbone_ids = {id(p) for p in backbone_params}
        other_params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in backbone_ids]
        return torch.optim.AdamW([{"params": other_params, "lr": cfg.lr},
                                  {"params": backbone_params, "lr": cfg.lr_backbone}],
                                 lr=cfg.lr, weight_decay=cfg.weight_decay)

    def build_loaders(self):
        cfg = self.cfg
        self.ds_train = build_dataset(image_set="train", args=cfg)
        self.ds_val = build_dataset(image_set="val", args=cfg)
        if cfg.distributed:
            self.sampler_train = DistributedSampler(self.ds_train)
            sampler_val = DistributedSampler(self.ds_val, shuffle=False)
        else:
            self.sampler_train = torch.utils.data.RandomSampler(self.ds_train)
            sampler_val = torch.utils.data.SequentialSampler(self.ds_val)
        self.loader_train = DataLoader(self.ds_train,
                                       batch_sampler=BatchSampler(self.sampler_train, cfg.batch_size, drop_last=True),
                                       collate_fn=utils.collate_fn, num_workers=cfg.num_workers, pin_memory=True)
        self.loader_val = DataLoader(self.ds_val, cfg.batch_size, sampler=sampler_val, drop_last=False,
                                     collate_fn=utils.collate_fn, num_workers=cfg.num_workers, pin_memory=True)
        self.base_ds = get_coco_api_from_dataset(self.ds_val)

    def resume(self, path):
        ckpt = torch.load(path, map_location="cpu")
        self.model_without_ddp.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        self.start_epoch = ckpt["epoch"] + 1
        logger.info("resumed from %s (epoch %d)", path, ckpt["epoch"])

    def train_epoch(self, epoch):
        self.model.train()
        self.criterion.train()
        wd = self.criterion.weight_dict
        meter = utils.MetricLogger(delimiter="  ")
        for samples, targets in meter.log_every(self.loader_train, 100, f"Epoch: [{epoch}]"):
            samples = samples.to(self.device)
            targets = [{k: v.to(self.device) for k, v in t.items()} for t in targets]
            loss_dict = self.criterion(self.model(samples), targets)
            loss = sum(loss_dict[k] * wd[k] for k in loss_dict if k in wd)
            reduced = utils.reduce_dict(loss_dict)
            loss_value = sum(reduced[k] * wd[k] for k in reduced if k in wd).item()
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value}: {reduced}")
            self.optimizer.zero_grad()
            loss.backward()
            if self.cfg.clip_max_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_max_norm)
            self.optimizer.step()
            meter.update(loss=loss_value, class_error=reduced["class_error"], lr=self.optimizer.param_groups[0]["lr"])
        meter.synchronize_between_processes()
        return {k: m.global_avg for k, m in meter.meters.items()}

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        self.criterion.eval()
        evaluator = CocoEvaluator(self.base_ds, ("bbox",))
        for samples, targets in self.loader_val:
            samples = samples.to(self.device)
            outputs = self.model(samples)
            orig = torch.stack([t["orig_size"] for t in targets]).to(self.device)
            res = self.postprocessors["bbox"](outputs, orig)
            evaluator.update({t["image_id"].item(): r for t, r in zip(targets, res)})
        evaluator.synchronize_between_processes()
        evaluator.accumulate()
        evaluator.summarize()
        return evaluator.coco_eval["bbox"].stats.tolist()

    def save(self, epoch, name="checkpoint.pth"):
        utils.save_on_master({"model": self.model_without_ddp.state_dict(),
                              "optimizer": self.optimizer.state_dict(),
                              "lr_scheduler": self.lr_scheduler.state_dict(),
                              "epoch": epoch, "cfg": vars(self.cfg)}, self.out_dir / name)

    def fit(self):
        best = 0.0
        for epoch in range(self.start_epoch, self.cfg.epochs):
            if self.cfg.distributed:
                self.sampler_train.set_epoch(epoch)
            t0 = time.time()
            train_stats = self.train_epoch(epoch)
            self.lr_scheduler.step()
            self.save(epoch)
            ap = self.evaluate()
            if ap[0] > best:
                best = ap[0]
                self.save(epoch, "best.pth")
            if utils.is_main_process():
                logger.info(json.dumps({"epoch": epoch, "AP": ap[0], "AP50": ap[1], "best": best,
                                        "minutes": (time.time() - t0) / 60, **train_stats}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="")
    parser.add_argument("--resume", default="")
    parser.add_argument("--eval_only", action="store_true")
    a = parser.parse_args()
    trainer = Trainer(load_config(a.config))
    if a.resume:
        trainer.resume(a.resume)
    if a.eval_only:
        trainer.evaluate()
    else:
        trainer.fit()
    if trainer.cfg.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
