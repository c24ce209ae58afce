# Deformable DETR with iterative box refinement + optional encoder proposal loss.
# Uses the compiled MSDeformAttn op and data/eval utilities from the Deformable-DETR repo.
#
#   GPUS_PER_NODE=8 torchrun --nproc_per_node=8 06_deformable_detr_refine.py \
#       --coco_path data/coco --output_dir exps/r50_refine
import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.init import constant_, normal_, xavier_uniform_
from torch.utils.data import DataLoader

import util.misc as utils
from datasets import build_dataset, get_coco_api_from_dataset
from datasets.coco_eval import CocoEvaluator
from models.backbone import build_backbone
from models.matcher import build_matcher
from models.deformable_detr import SetCriterion, PostProcess, MLP
from models.ops.modules import MSDeformAttn
import datasets.samplers as samplers


def inverse_sigmoid(x, eps=1e-5):
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


class EncLayer(nn.Module):
    def __init__(self, d=256, ffn=1024, dropout=0.1, n_levels=4):
        super().__init__()
        self.self_attn = MSDeformAttn(d, n_levels, 8, 4)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.linear1, self.linear2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src, pos, ref, shapes, level_start, mask):
        src = self.norm1(src + self.dropout(self.self_attn(src + pos, ref, src, shapes, level_start, mask)))
        return self.norm2(src + self.dropout(self.linear2(self.dropout(F.relu(self.linear1(src))))))


class DecLayer(nn.Module):
    def __init__(self, d=256, ffn=1024, dropout=0.1, n_levels=4):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, 8, dropout=dropout)
        self.cross_attn = MSDeformAttn(d, n_levels, 8, 4)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.linear1, self.linear2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tgt, query_pos, ref, memory, shapes, level_start, mask):
        q = k = tgt + query_pos
        tgt2 = self.self_attn(q.transpose(0, 1), k.transpose(0, 1), tgt.transpose(0, 1))[0].transpose(0, 1)
        tgt = self.norm1(tgt + self.dropout(tgt2))
        tgt = self.norm2(tgt + self.dropout(self.cross_attn(tgt + query_pos, ref, memory, shapes, level_start, mask)))
        return self.norm3(tgt + self.dropout(self.linear2(self.dropout(F.relu(self.linear1(tgt))))))


class DeformableDETRRefine(nn.Module):
    def __init__(self, backbone, num_classes, num_queries=300, d=256, n_levels=4, n_enc=6, n_dec=6, two_stage=False):
        super().__init__()
        self.backbone, self.num_queries, self.two_stage = backbone, num_queries, two_stage
        proj = [nn.Sequential(nn.Conv2d(c, d, 1), nn.GroupNorm(32, d)) for c in backbone.num_channels]
        in_c = backbone.num_channels[-1]
        for _ in range(n_levels - len(proj)):
            proj.append(nn.Sequential(nn.Conv2d(in_c, d, 3, stride=2, padding=1), nn.GroupNorm(32, d)))
            in_c = d
        self.input_proj = nn.ModuleList(proj)
        self.level_embed = nn.Parameter(torch.Tensor(n_levels, d))
        self.encoder = nn.ModuleList(EncLayer(d, n_levels=n_levels) for _ in range(n_enc))
        self.decoder = nn.ModuleList(DecLayer(d, n_levels=n_levels) for _ in range(n_dec))
        self.query_embed = nn.Embedding(num_queries, 2 * d)
        self.reference_points = nn.Linear(d, 2)

        class_embed = nn.Linear(d, num_classes)
        bbox_embed = MLP(d, d, 4, 3)
        class_embed.bias.data = torch.ones(num_classes) * -math.log((1 - 0.01) / 0.01)
        constant_(bbox_embed.layers[-1].weight.data, 0)
        constant_(bbox_embed.layers[-1].bias.data, 0)
        constant_(bbox_embed.layers[-1].bias.data[2:], -2.0)
        # one head per decoder layer (box refinement)
        self.class_embed = nn.ModuleList(copy.deepcopy(class_embed) for _ in range(n_dec))
        self.bbox_embed = nn.ModuleList(copy.deepcopy(bbox_embed) for _ in range(n_dec))

        # encoder proposal heads (two-stage style auxiliary loss on the memory)
        self.enc_output = nn.Linear(d, d)
        self.enc_output_norm = nn.LayerNorm(d)
        self.enc_class_embed = copy.deepcopy(class_embed)
        self.enc_bbox_embed = copy.deepcopy(bbox_embed)

        normal_(self.level_embed)
        xavier_uniform_(self.reference_points.weight.data, gain=1.0)
        constant_(self.reference_points.bias.data, 0.0)

    def _enc_proposals(self, memory, mask, shapes):
        props, start = [], 0
        for lvl, (H, W) in enumerate(shapes.tolist()):
            valid = ~mask[:, start:start + H * W].view(-1, H, W)
            vh, vw = valid[:, :, 0].sum(1), valid[:, 0, :].sum(1)
            gy, gx = torch.meshgrid(torch.arange(H, device=memory.device), torch.arange(W, device=memory.device),
                                    indexing="ij")
            grid = torch.stack([gx, gy], -1).float()[None] + 0.5
            grid = grid / torch.stack([vw, vh], -1).view(-1, 1, 1, 2)
            wh = torch.full_like(grid, 0.05 * 2.0 ** lvl)
            props.append(torch.cat([grid, wh], -1).view(memory.shape[0], -1, 4))
            start += H * W
        props = torch.cat(props, 1)
        out_mem = self.enc_output_norm(self.enc_output(memory.masked_fill(mask[..., None], 0.0)))
        delta = self.enc_bbox_embed(out_mem)
        return {"pred_logits": self.enc_class_embed(out_mem),
                "pred_boxes": (delta + inverse_sigmoid(props)).sigmoid()}

    def forward(self, samples: utils.NestedTensor):
        features, pos = self.backbone(samples)
        srcs, masks = [], []
        for l, feat in enumerate(features):
            src, mask = feat.decompose()
            srcs.append(self.input_proj[l](src))
            masks.append(mask)
        for l in range(len(features), len(self.input_proj)):
            src = self.input_proj[l](features[-1].tensors if l == len(features) else srcs[-1])
            m = F.interpolate(samples.mask[None].float(), size=src.shape[-2:]).to(torch.bool)[0]
            srcs.append(src)
            masks.append(m)
            pos.append(self.backbone[1](utils.NestedTensor(src, m)).to(src.dtype))

        shapes = torch.as_tensor([s.shape[-2:] for s in srcs], dtype=torch.long, device=srcs[0].device)
        level_start = torch.cat((shapes.new_zeros((1,)), shapes.prod(1).cumsum(0)[:-1]))
        valid = torch.stack([torch.stack([(~m[:, 0, :]).sum(1) / m.shape[2], (~m[:, :, 0]).sum(1) / m.shape[1]], -1)
                             for m in masks], 1).float()
        src_flat = torch.cat([s.flatten(2).transpose(1, 2) for s in srcs], 1)
        mask_flat = torch.cat([m.flatten(1) for m in masks], 1)
        pos_flat = torch.cat([p.flatten(2).transpose(1, 2) + self.level_embed[l].view(1, 1, -1)
                              for l, p in enumerate(pos)], 1)

        refs = []
        for lvl, (H, W) in enumerate(shapes.tolist()):
            ry, rx = torch.meshgrid(torch.linspace(0.5, H - 0.5, H, device=src_flat.device),
                                    torch.linspace(0.5, W - 0.5, W, device=src_flat.device), indexing="ij")
            refs.append(torch.stack((rx.reshape(-1)[None] / (valid[:, None, lvl, 0] * W),
                                     ry.reshape(-1)[None] / (valid[:, None, lvl, 1] * H)), -1))
        enc_ref = torch.cat(refs, 1)[:, :, None] * valid[:, None]
        memory = src_flat
        for layer in self.encoder:
            memory = layer(memory, pos_flat, enc_ref, shapes, level_start, mask_flat)

        bs = memory.shape[0]
        query_pos, tgt = torch.split(self.query_embed.weight, memory.shape[-1], dim=1)
        query_pos, tgt = query_pos.unsqueeze(0).expand(bs, -1, -1), tgt.unsqueeze(0).expand(bs, -1, -1)
        reference = self.reference_points(query_pos).sigmoid()
        outputs = []
        for lid, layer in enumerate(self.decoder):
            tgt = layer(tgt, query_pos, reference[:, :, None] * valid[:, None], memory, shapes, level_start, mask_flat)
            tmp = self.bbox_embed[lid](tgt)
            if reference.shape[-1] == 2:
                tmp = torch.cat([tmp[..., :2] + inverse_sigmoid(reference), tmp[..., 2:]], -1)
            else:
                tmp = tmp + inverse_sigmoid(reference)
            boxes = tmp.sigmoid()
            outputs.append({"pred_logits": self.class_embed[lid](tgt), "pred_boxes": boxes})
            reference = boxes[..., :2].detach()

        out = dict(outputs[-1])
        out["aux_outputs"] = outputs[:-1]
        if self.two_stage:
            out["enc_outputs"] = self._enc_proposals(memory, mask_flat, shapes)
        return out


def main(args):
    utils.init_distributed_mode(args)
    device = torch.device(args.device)
    seed = args.seed + utils.get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    backbone = build_backbone(args)
    model = DeformableDETRRefine(backbone, num_classes=91, num_queries=args.num_queries, two_stage=args.two_stage)
    matcher = build_matcher(args)
    weight_dict = {"loss_ce": 2, "loss_bbox": 5, "loss_giou": 2}
    aux = {}
    for i in range(5):
        aux.update({k + f"_{i}": v for k, v in weight_dict.items()})
    aux.update({k + "_enc": v for k, v in weight_dict.items()})
    weight_dict.update(aux)
    criterion = SetCriterion(91, matcher, weight_dict, ["labels", "boxes", "cardinality"], focal_alpha=0.25).to(device)
    postprocessors = {"bbox": PostProcess()}
    model.to(device)

    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    def match(n, keys):
        return any(k in n for k in keys)

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if not match(n, ["backbone.0", "reference_points", "sampling_offsets"]) and p.requires_grad],
         "lr": args.lr},
        {"params": [p for n, p in model_without_ddp.named_parameters() if match(n, ["backbone.0"]) and p.requires_grad],
         "lr": args.lr_backbone},
        {"params": [p for n, p in model_without_ddp.named_parameters()
                    if match(n, ["reference_points", "sampling_offsets"]) and p.requires_grad],
         "lr": args.lr * 0.1},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=1e-4)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    dataset_train = build_dataset(image_set="train", args=args)
    dataset_val = build_dataset(image_set="val", args=args)
    if args.distributed:
        sampler_train = samplers.DistributedSampler(dataset_train)
        sampler_val = samplers.DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    loader_train = DataLoader(dataset_train, batch_sampler=torch.utils.data.BatchSampler(sampler_train,
                                                                                        args.batch_size, drop_last=True),
                              collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                            collate_fn=utils.collate_fn, num_workers=args.num_workers, pin_memory=True)
    base_ds = get_coco_api_from_dataset(dataset_val)
    output_dir = Path(args.output_dir)

    for epoch in range(args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        model.train()
        criterion.train()
        logger = utils.MetricLogger(delimiter="  ")
        for samples, targets in logger.log_every(loader_train, 100, f"Epoch: [{epoch}]"):
            samples = samples.to(device)
            targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
            loss_dict = criterion(model(samples), targets)
            losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict if k in weight_dict)
            optimizer.zero_grad()
            losses.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_max_norm)
            optimizer.step()
            reduced = utils.reduce_dict(loss_dict)
            logger.update(loss=sum(reduced[k] * weight_dict[k] for k in reduced if k in weight_dict).item())
        lr_scheduler.step()
        logger.synchronize_between_processes()

        model.eval()
        evaluator = CocoEvaluator(base_ds, ("bbox",))
        with torch.no_grad():
            for samples, targets in loader_val:
                outputs = model(samples.to(device))
                sizes = torch.stack([t["orig_size"] for t in targets]).to(device)
                res = postprocessors["bbox"](outputs, sizes)
                evaluator.update({t["image_id"].item(): r for t, r in zip(targets, res)})
        evaluator.synchronize_between_processes()
        evaluator.accumulate()
        evaluator.summarize()

        utils.save_on_master({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                              "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch, "args": args},
                             output_dir / "checkpoint.pth")
        if utils.is_main_process():
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps({"epoch": epoch, "train_loss": logger.meters["loss"].global_avg,
                                    "bbox": evaluator.coco_eval["bbox"].stats.tolist()}) + "\n")

    if args.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser("Deformable DETR refine")
    parser.add_argument("--lr", default=2e-4, type=float)
    parser.add_argument("--lr_backbone", default=2e-5, type=float)
    parser.add_argument("--batch_size", default=2, type=int)
    parser.add_argument("--epochs", default=50, type=int)
    parser.add_argument("--lr_drop", default=40, type=int)
    parser.add_argument("--clip_max_norm", default=0.1, type=float)
    parser.add_argument("--num_queries", default=300, type=int)
    parser.add_argument("--two_stage", action="store_true")
    parser.add_argument("--backbone", default="resnet50")
    parser.add_argument("--dilation", action="store_true")
    parser.add_argument("--position_embedding", default="sine")
    parser.add_argument("--position_embedding_scale", default=2 * np.pi, type=float)
    parser.add_argument("--num_feature_levels", default=4, type=int)
    parser.add_argument("--hidden_dim", default=256, type=int)
    parser.add_argument("--masks", action="store_true")
    parser.add_argument("--set_cost_class", default=2, type=float)
    parser.add_argument("--set_cost_bbox", default=5, type=float)
    parser.add_argument("--set_cost_giou", default=2, type=float)
    parser.add_argument("--dataset_file", default="coco")
    parser.add_argument("--coco_path", default="./data/coco")
    parser.add_argument("--cache_mode", action="store_true")
    parser.add_argument("--output_dir", default="exps/r50_refine")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", default=42, type=int)
    parser.add_argument("--num_workers", default=2, type=int)
    parser.add_argument("--dist_url", default="env://")
    args = parser.parse_args()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
