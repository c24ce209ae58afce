# DETR training on COCO 2017 (ResNet-50 backbone, 6+6 transformer layers).
import argparse
import datetime
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.ops import box_convert, generalized_box_iou
from torchvision.ops.misc import FrozenBatchNorm2d

class MetricLogger(object):
    def __init__(self, delimiter="\t"):
        self.totals = defaultdict(float)
        self.counts = defaultdict(int)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            self.totals[k] += v.item() if isinstance(v, torch.Tensor) else v
            self.counts[k] += 1

    def synchronize_between_processes(self):
        if not is_dist_avail_and_initialized():
            return
        keys = sorted(self.totals.keys())
        t = torch.tensor([[self.totals[k], self.counts[k]] for k in keys], dtype=torch.float64, device='cuda')
        dist.barrier()
        dist.all_reduce(t)
        for k, (total, count) in zip(keys, t.tolist()):
            self.totals[k], self.counts[k] = total, int(count)

    def global_avg(self):
        return {k: self.totals[k] / max(self.counts[k], 1) for k in self.totals}

    def __str__(self):
        return self.delimiter.join("{}: {:.4f}".format(k, v) for k, v in self.global_avg().items())

    def log_every(self, iterable, print_freq, header=''):
        start = time.time()
        for i, obj in enumerate(iterable):
            yield obj
            if i % print_freq == 0 or i == len(iterable) - 1:
                eta = int((time.time() - start) / (i + 1) * (len(iterable) - i - 1))
                print('{} [{}/{}] eta: {} {}'.format(header, i, len(iterable), datetime.timedelta(seconds=eta), self))

def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()

def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1

def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0

def is_main_process():
    return get_rank() == 0

def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)

def all_gather(data):
    """Run all_gather on arbitrary picklable data (not necessarily tensors)."""
    world_size = get_world_size()
    if world_size == 1:
        return [data]
    output = [None] * world_size
    dist.all_gather_object(output, data)
    return output

def reduce_dict(input_dict, average=True):
    world_size = get_world_size()
    if world_size < 2:
        return input_dict
    with torch.no_grad():
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names], dim=0)
        dist.all_reduce(values)
        return {k: v for k, v in zip(names, values / world_size if average else values)}

def setup_for_distributed(is_master):
    import builtins as __builtin__
    builtin_print = __builtin__.print

    def print(*args, **kwargs):
        force = kwargs.pop('force', False)
        if is_master or force:
            builtin_print(*args, **kwargs)
    __builtin__.print = print

def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank = int(os.environ["RANK"])
        args.world_size = int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    elif 'SLURM_PROCID' in os.environ:
        args.rank = int(os.environ['SLURM_PROCID'])
        args.world_size = int(os.environ['SLURM_NTASKS'])
        args.gpu = args.rank % torch.cuda.device_count()
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    print('| distributed init (rank {}): {}'.format(args.rank, args.dist_url), flush=True)
    dist.init_process_group(backend='nccl', init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    dist.barrier()
    setup_for_distributed(args.rank == 0)

class NestedTensor(object):
    def __init__(self, tensors, mask):
        self.tensors = tensors
        self.mask = mask

    def to(self, device, non_blocking=False):
        return NestedTensor(self.tensors.to(device, non_blocking=non_blocking), self.mask.to(device, non_blocking=non_blocking))

def nested_tensor_from_tensor_list(tensor_list):
    c, h, w = [max(s) for s in zip(*[img.shape for img in tensor_list])]
    tensor = torch.zeros((len(tensor_list), c, h, w), dtype=tensor_list[0].dtype)
    mask = torch.ones((len(tensor_list), h, w), dtype=torch.bool)
    for img, pad_img, m in zip(tensor_list, tensor, mask):
        pad_img[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], : img.shape[2]] = False
    return NestedTensor(tensor, mask)

def collate_fn(batch):
    batch = list(zip(*batch))
    batch[0] = nested_tensor_from_tensor_list(batch[0])
    return tuple(batch)

class CocoDetection(torchvision.datasets.CocoDetection):
    def __init__(self, img_folder, ann_file, train):
        super().__init__(img_folder, ann_file)
        self.train = train
        self.normalize = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        w, h = img.size
        anns = [a for a in anns if a.get('iscrowd', 0) == 0]
        boxes = torch.as_tensor([a['bbox'] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes = torch.min(boxes.clamp(min=0), torch.tensor([w, h, w, h], dtype=torch.float32))
        labels = torch.tensor([a['category_id'] for a in anns], dtype=torch.int64)
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        boxes, labels = boxes[keep], labels[keep]
        size = random.choice([480, 544, 608, 672, 736, 800]) if self.train else 800
        img = TF.resize(img, size, max_size=1333)
        boxes = box_convert(boxes, 'xyxy', 'cxcywh') / torch.tensor([w, h, w, h], dtype=torch.float32)
        target = {'boxes': boxes, 'labels': labels, 'image_id': torch.tensor([self.ids[idx]]),
                  'orig_size': torch.as_tensor([h, w])}
        return self.normalize(img), target

class DETR(nn.Module):
    def __init__(self, num_classes, num_queries=100, hidden_dim=256, nheads=8, enc_layers=6, dec_layers=6):
        super().__init__()
        backbone = torchvision.models.resnet50(weights='IMAGENET1K_V1', norm_layer=FrozenBatchNorm2d)
        for name, p in backbone.named_parameters():
            if 'layer2' not in name and 'layer3' not in name and 'layer4' not in name:
                p.requires_grad_(False)
        self.backbone = nn.Sequential(*list(backbone.children())[:-2])
        self.input_proj = nn.Conv2d(2048, hidden_dim, kernel_size=1)
        self.transformer = nn.Transformer(hidden_dim, nheads, enc_layers, dec_layers, dim_feedforward=2048, dropout=0.1)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.row_embed = nn.Parameter(torch.rand(64, hidden_dim // 2))
        self.col_embed = nn.Parameter(torch.rand(64, hidden_dim // 2))
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.bbox_embed = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
                                        nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 4))

    def forward(self, samples):
        feat = self.backbone(samples.tensors)
        mask = F.interpolate(samples.mask[None].float(), size=feat.shape[-2:])[0].to(torch.bool).flatten(1)
        h, w = feat.shape[-2:]
        src = self.input_proj(feat).flatten(2).permute(2, 0, 1)
        pos = torch.cat([self.col_embed[:w].unsqueeze(0).repeat(h, 1, 1),
                         self.row_embed[:h].unsqueeze(1).repeat(1, w, 1)], dim=-1).flatten(0, 1).unsqueeze(1)
        tgt = self.query_embed.weight.unsqueeze(1).repeat(1, src.shape[1], 1)
        hs = self.transformer(src + pos, tgt, src_key_padding_mask=mask, memory_key_padding_mask=mask).transpose(0, 1)
        return {'pred_logits': self.class_embed(hs), 'pred_boxes': self.bbox_embed(hs).sigmoid()}

class SetCriterion(nn.Module):
    def __init__(self, num_classes, eos_coef=0.1, cost_class=1., cost_bbox=5., cost_giou=2.):
        super().__init__()
        self.num_classes = num_classes
        self.costs = (cost_class, cost_bbox, cost_giou)
        self.weight_dict = {'loss_ce': 1., 'loss_bbox': cost_bbox, 'loss_giou': cost_giou}
        self.register_buffer('empty_weight', torch.cat([torch.ones(num_classes), torch.tensor([eos_coef])]))

    @torch.no_grad()
    def match(self, outputs, targets):
        bs, nq = outputs['pred_logits'].shape[:2]
        prob = outputs['pred_logits'].flatten(0, 1).softmax(-1)
        out_bbox = outputs['pred_boxes'].flatten(0, 1)
        tgt_ids = torch.cat([t['labels'] for t in targets])
        tgt_bbox = torch.cat([t['boxes'] for t in targets])
        C = self.costs[1] * torch.cdist(out_bbox, tgt_bbox, p=1) - self.costs[0] * prob[:, tgt_ids] \
            - self.costs[2] * generalized_box_iou(box_convert(out_bbox, 'cxcywh', 'xyxy'), box_convert(tgt_bbox, 'cxcywh', 'xyxy'))
        C = C.view(bs, nq, -1).cpu()
        sizes = [len(t['boxes']) for t in targets]
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(C.split(sizes, -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]

    def forward(self, outputs, targets):
        indices = self.match(outputs, targets)
        num_boxes = torch.as_tensor([sum(len(t['labels']) for t in targets)], dtype=torch.float,
                                    device=outputs['pred_logits'].device)
        if is_dist_avail_and_initialized():
            dist.all_reduce(num_boxes)
        num_boxes = torch.clamp(num_boxes / get_world_size(), min=1).item()

        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for (src, _) in indices])
        logits = outputs['pred_logits']
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        target_classes[batch_idx, src_idx] = torch.cat([t['labels'][J] for t, (_, J) in zip(targets, indices)])
        loss_ce = F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight)

        src_boxes = outputs['pred_boxes'][batch_idx, src_idx]
        tgt_boxes = torch.cat([t['boxes'][J] for t, (_, J) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, tgt_boxes, reduction='none').sum() / num_boxes
        loss_giou = (1 - torch.diag(generalized_box_iou(box_convert(src_boxes, 'cxcywh', 'xyxy'),
                                                        box_convert(tgt_boxes, 'cxcywh', 'xyxy')))).sum() / num_boxes
        return {'loss_ce': loss_ce, 'loss_bbox': loss_bbox, 'loss_giou': loss_giou}

def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, max_norm):
    model.train()
    criterion.train()
    metric_logger = MetricLogger(delimiter="  ")
    for samples, targets in metric_logger.log_every(data_loader, 100, 'Epoch: [{}]'.format(epoch)):
        samples = samples.to(device, non_blocking=True)
        targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        losses = sum(loss_dict[k] * criterion.weight_dict[k] for k in loss_dict)

        loss_dict_reduced = reduce_dict(loss_dict)
        loss_value = sum(loss_dict_reduced[k] * criterion.weight_dict[k] for k in loss_dict_reduced).item()
        if not np.isfinite(loss_value):
            print("Loss is {}, stopping training".format(loss_value), loss_dict_reduced)
            sys.exit(1)

        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        metric_logger.update(loss=loss_value, lr=optimizer.param_groups[0]["lr"], **loss_dict_reduced)
    metric_logger.synchronize_between_processes()
    print("Averaged stats:", metric_logger)
    return metric_logger.global_avg()

@torch.no_grad()
def evaluate(model, data_loader, base_ds, device):
    model.eval()
    metric_logger = MetricLogger(delimiter="  ")
    results = {}
    for samples, targets in metric_logger.log_every(data_loader, 50, 'Test:'):
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]
        outputs = model(samples)
        scores, labels = outputs['pred_logits'].softmax(-1)[..., :-1].max(-1)
        img_h, img_w = torch.stack([t['orig_size'] for t in targets], dim=0).unbind(1)
        boxes = box_convert(outputs['pred_boxes'], 'cxcywh', 'xyxy') * torch.stack([img_w, img_h, img_w, img_h], 1)[:, None]
        for t, s, l, b in zip(targets, scores, labels, boxes):
            results[t['image_id'].item()] = {'scores': s.cpu(), 'labels': l.cpu(), 'boxes': b.cpu()}
    # DistributedSampler pads the last batch; keying by image_id drops the duplicates
    gathered = all_gather(results)
    stats = {}
    if is_main_process():
        merged = {}
        for r in gathered:
            merged.update(r)
        dets = []
        for img_id, r in merged.items():
            for s, l, b in zip(r['scores'].tolist(), r['labels'].tolist(), r['boxes'].tolist()):
                dets.append({'image_id': img_id, 'category_id': l, 'score': s,
                             'bbox': [b[0], b[1], b[2] - b[0], b[3] - b[1]]})
        coco_eval = COCOeval(base_ds, base_ds.loadRes(dets) if dets else COCO(), 'bbox')
        coco_eval.params.imgIds = sorted(merged.keys())
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
        stats['coco_eval_bbox'] = coco_eval.stats.tolist()
    return stats

def get_args_parser():
    parser = argparse.ArgumentParser('Set transformer detector', add_help=False)
    parser.add_argument('--lr', default=1e-4, type=float)
    parser.add_argument('--lr_backbone', default=1e-5, type=float)
    parser.add_argument('--batch_size', default=2, type=int)
    parser.add_argument('--weight_decay', default=1e-4, type=float)
    parser.add_argument('--epochs', default=300, type=int)
    parser.add_argument('--lr_drop', default=200, type=int)
    parser.add_argument('--clip_max_norm', default=0.1, type=float)
    parser.add_argument('--coco_path', type=str, required=True)
    parser.add_argument('--output_dir', default='')
    parser.add_argument('--seed', default=42, type=int)
    parser.add_argument('--resume', default='')
    parser.add_argument('--start_epoch', default=0, type=int)
    parser.add_argument('--num_workers', default=2, type=int)
    parser.add_argument('--dist_url', default='env://')
    return parser

def main(args):
    init_distributed_mode(args)
    print(args)
    device = torch.device('cuda')

    seed = args.seed + get_rank()
    torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)

    model = DETR(num_classes=91).to(device)
    criterion = SetCriterion(num_classes=91).to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)

    root = Path(args.coco_path)
    dataset_train = CocoDetection(root / 'train2017', root / 'annotations' / 'instances_train2017.json', train=True)
    dataset_val = CocoDetection(root / 'val2017', root / 'annotations' / 'instances_val2017.json', train=False)
    if args.distributed:
        sampler_train = DistributedSampler(dataset_train)
        sampler_val = DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    batch_sampler_train = torch.utils.data.BatchSampler(sampler_train, args.batch_size, drop_last=True)
    data_loader_train = DataLoader(dataset_train, batch_sampler=batch_sampler_train,
                                   collate_fn=collate_fn, num_workers=args.num_workers)
    data_loader_val = DataLoader(dataset_val, args.batch_size, sampler=sampler_val, drop_last=False,
                                 collate_fn=collate_fn, num_workers=args.num_workers)
    base_ds = dataset_val.coco

    output_dir = Path(args.output_dir)
    if args.resume:
        checkpoint = torch.load(args.resume, map_location='cpu')
        model_without_ddp.load_state_dict(checkpoint['model'])
        if 'optimizer' in checkpoint:
            optimizer.load_state_dict(checkpoint['optimizer'])
            lr_scheduler.load_state_dict(checkpoint['lr_scheduler'])
            args.start_epoch = checkpoint['epoch'] + 1

    for epoch in range(args.start_epoch, args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, data_loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        if args.output_dir:
            save_on_master({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                            'lr_scheduler': lr_scheduler.state_dict(), 'epoch': epoch, 'args': args},
                           output_dir / 'checkpoint.pth')

        test_stats = evaluate(model, data_loader_val, base_ds, device)
        log_stats = {**{f'train_{k}': v for k, v in train_stats.items()},
                     **{f'test_{k}': v for k, v in test_stats.items()},
                     'epoch': epoch}
        if args.output_dir and is_main_process():
            with (output_dir / "log.txt").open("a") as f:
                f.write(json.dumps(log_stats) + "\n")

    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser('DETR training and evaluation script', parents=[get_args_parser()])
    args = parser.parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
