# YOLOS-style detector (ViT + detection tokens) fine-tuned on a COCO-format dataset (CrowdHuman full-body boxes).
import argparse
import datetime
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from pycocotools.cocoeval import COCOeval
from scipy.optimize import linear_sum_assignment
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process():
    return get_rank() == 0


def init_distributed_mode(args):
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ['WORLD_SIZE'])
        args.gpu = int(os.environ['LOCAL_RANK'])
    else:
        print('Not using distributed mode')
        args.distributed = False
        return
    args.distributed = True
    torch.cuda.set_device(args.gpu)
    dist.init_process_group(backend='nccl', init_method='env://', world_size=args.world_size, rank=args.rank)
    dist.barrier()


def reduce_dict(input_dict):
    if get_world_size() < 2:
        return input_dict
    with torch.no_grad():
        names = sorted(input_dict.keys())
        values = torch.stack([input_dict[k] for k in names])
        dist.all_reduce(values)
        return {k: v for k, v in zip(names, values / get_world_size())}


def collate_fn(batch):
    imgs, targets = zip(*batch)
    h = max(i.shape[1] for i in imgs)
    w = max(i.shape[2] for i in imgs)
    h, w = int(math.ceil(h / 16) * 16), int(math.ceil(w / 16) * 16)
    out = torch.zeros(len(imgs), 3, h, w)
    for i, img in enumerate(imgs):
        out[i, :, :img.shape[1], :img.shape[2]].copy_(img)
    return out, list(targets)


class CocoFormatDetection(torchvision.datasets.CocoDetection):
    def __init__(self, img_folder, ann_file, train):
        super().__init__(img_folder, ann_file)
        self.train = train
        self.norm = T.Compose([T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __getitem__(self, idx):
        img, anns = super().__getitem__(idx)
        w, h = img.size
        anns = [a for a in anns if not a.get('iscrowd', 0) and not a.get('ignore', 0)]
        boxes = torch.as_tensor([a['bbox'] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes = torch.min(boxes.clamp(min=0), torch.tensor([w, h, w, h], dtype=torch.float32))
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        boxes = boxes[keep]
        labels = torch.tensor([a['category_id'] for a in anns], dtype=torch.int64)[keep]
        if self.train and random.random() < 0.5:
            img = TF.hflip(img)
            boxes = boxes[:, [2, 1, 0, 3]] * torch.tensor([-1., 1., -1., 1.]) + torch.tensor([w, 0., w, 0.])
        img = TF.resize(img, random.choice([480, 512, 544, 576, 608]) if self.train else 608, max_size=1024)
        boxes = box_convert(boxes, 'xyxy', 'cxcywh') / torch.tensor([w, h, w, h], dtype=torch.float32)
        return self.norm(img), {'boxes': boxes, 'labels': labels, 'image_id': self.ids[idx], 'orig_size': (h, w)}


class YOLOS(nn.Module):
    def __init__(self, backbone, num_classes, det_token_num=100):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=True, num_classes=0, dynamic_img_size=True)
        dim = self.backbone.embed_dim
        self.det_token_num = det_token_num
        self.det_token = nn.Parameter(torch.zeros(1, det_token_num, dim))
        self.det_pos_embed = nn.Parameter(torch.zeros(1, det_token_num, dim))
        nn.init.trunc_normal_(self.det_token, std=.02)
        nn.init.trunc_normal_(self.det_pos_embed, std=.02)
        self.class_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, num_classes + 1))
        self.bbox_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))

    def forward(self, x):
        x = self.backbone._pos_embed(self.backbone.patch_embed(x))
        det = (self.det_token + self.det_pos_embed).expand(x.shape[0], -1, -1)
        x = self.backbone.norm_pre(torch.cat([x, det], dim=1))
        for blk in self.backbone.blocks:
            x = blk(x)
        x = self.backbone.norm(x)[:, -self.det_token_num:]
        return {'pred_logits': self.class_embed(x), 'pred_boxes': self.bbox_embed(x).sigmoid()}


class SetCriterion(nn.Module):
    def __init__(self, num_classes, eos_coef=0.1):
        super().__init__()
        self.num_classes = num_classes
        self.weight_dict = {'loss_ce': 1., 'loss_bbox': 5., 'loss_giou': 2.}
        self.register_buffer('empty_weight', torch.cat([torch.ones(num_classes), torch.tensor([eos_coef])]))

    @torch.no_grad()
    def match(self, outputs, targets):
        bs, nq = outputs['pred_logits'].shape[:2]
        prob = outputs['pred_logits'].flatten(0, 1).softmax(-1)
        out_bbox = outputs['pred_boxes'].flatten(0, 1)
        tgt_ids = torch.cat([t['labels'] for t in targets])
        tgt_bbox = torch.cat([t['boxes'] for t in targets])
        C = 5 * torch.cdist(out_bbox, tgt_bbox, p=1) - prob[:, tgt_ids] - 2 * generalized_box_iou(
            box_convert(out_bbox, 'cxcywh', 'xyxy'), box_convert(tgt_bbox, 'cxcywh', 'xyxy'))
        C = C.view(bs, nq, -1).cpu()
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(C.split([len(t['boxes']) for t in targets], -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]

    def forward(self, outputs, targets):
        indices = self.match(outputs, targets)
        num_boxes = torch.as_tensor([float(sum(len(t['labels']) for t in targets))], device=outputs['pred_boxes'].device)
        if is_dist_avail_and_initialized():
            dist.all_reduce(num_boxes)
        num_boxes = torch.clamp(num_boxes / get_world_size(), min=1).item()
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for (src, _) in indices])
        logits = outputs['pred_logits']
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        target_classes[batch_idx, src_idx] = torch.cat([t['labels'][J] for t, (_, J) in zip(targets, indices)])
        src_boxes = outputs['pred_boxes'][batch_idx, src_idx]
        tgt_boxes = torch.cat([t['boxes'][J] for t, (_, J) in zip(targets, indices)])
        giou = generalized_box_iou(box_convert(src_boxes, 'cxcywh', 'xyxy'), box_convert(tgt_boxes, 'cxcywh', 'xyxy'))
        return {'loss_ce': F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight),
                'loss_bbox': F.l1_loss(src_boxes, tgt_boxes, reduction='sum') / num_boxes,
                'loss_giou': (1 - torch.diag(giou)).sum() / num_boxes}


def train_one_epoch(model, criterion, data_loader, optimizer, device, epoch, max_norm):
    model.train()
    running, n_iter = 0.0, 0
    for it, (samples, targets) in enumerate(data_loader):
        # images whose boxes were all filtered out give nothing to match against
        if sum(len(t['labels']) for t in targets) == 0:
            continue
        samples = samples.to(device, non_blocking=True)
        targets = [{'boxes': t['boxes'].to(device), 'labels': t['labels'].to(device)} for t in targets]
        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        losses = sum(loss_dict[k] * criterion.weight_dict[k] for k in loss_dict)
        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        loss_dict_reduced = reduce_dict({k: v.detach() for k, v in loss_dict.items()})
        loss_value = sum(loss_dict_reduced[k] * criterion.weight_dict[k] for k in loss_dict_reduced).item()
        running += loss_value
        n_iter += 1
        if it % 50 == 0:
            print('Epoch: [{}] [{}/{}] loss: {:.4f} ({})'.format(epoch, it, len(data_loader), loss_value,
                  ' '.join('{}: {:.4f}'.format(k, v.item()) for k, v in loss_dict_reduced.items())))
    return {'loss': running / max(n_iter, 1), 'lr': optimizer.param_groups[0]['lr']}


@torch.no_grad()
def evaluate(model, data_loader, coco_gt, device):
    model.eval()
    results = {}
    for samples, targets in data_loader:
        outputs = model(samples.to(device))
        scores, labels = outputs['pred_logits'].softmax(-1)[..., :-1].max(-1)
        boxes = box_convert(outputs['pred_boxes'], 'cxcywh', 'xyxy')
        for t, s, l, b in zip(targets, scores.tolist(), labels.tolist(), boxes):
            h, w = t['orig_size']
            b = (b * torch.tensor([w, h, w, h], device=b.device)).tolist()
            results[t['image_id']] = [{'image_id': t['image_id'], 'category_id': li, 'score': si,
                                       'bbox': [bi[0], bi[1], bi[2] - bi[0], bi[3] - bi[1]]} for si, li, bi in zip(s, l, b)]
    gathered = [None] * get_world_size()
    if get_world_size() > 1:
        dist.all_gather_object(gathered, results)
    else:
        gathered = [results]
    if not is_main_process():
        return {}
    merged = {}
    for r in gathered:
        merged.update(r)  # padded duplicates from DistributedSampler collapse onto the same image_id
    coco_eval = COCOeval(coco_gt, coco_gt.loadRes([d for v in merged.values() for d in v]), 'bbox')
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return {'AP': coco_eval.stats[0], 'AP50': coco_eval.stats[1]}


def main(args):
    init_distributed_mode(args)
    device = torch.device('cuda')
    seed = args.seed + get_rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)

    root = Path(args.data_path)
    dataset_train = CocoFormatDetection(root / 'Images', root / 'annotations' / 'train.json', train=True)
    dataset_val = CocoFormatDetection(root / 'Images', root / 'annotations' / 'val.json', train=False)
    if args.distributed:
        sampler_train = torch.utils.data.DistributedSampler(dataset_train)
        sampler_val = torch.utils.data.DistributedSampler(dataset_val, shuffle=False)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset_train)
        sampler_val = torch.utils.data.SequentialSampler(dataset_val)
    loader_train = torch.utils.data.DataLoader(dataset_train, batch_size=args.batch_size, sampler=sampler_train, drop_last=True,
                                               collate_fn=collate_fn, num_workers=args.num_workers, pin_memory=True)
    loader_val = torch.utils.data.DataLoader(dataset_val, batch_size=args.batch_size, sampler=sampler_val,
                                             collate_fn=collate_fn, num_workers=args.num_workers)

    model = YOLOS(args.backbone, num_classes=args.num_classes, det_token_num=args.det_token_num).to(device)
    criterion = SetCriterion(args.num_classes).to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [args.lr_drop])

    start_epoch = 0
    ckpt_file = os.path.join(args.output_dir, 'checkpoint.pth')
    if os.path.exists(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location='cpu')
        model_without_ddp.load_state_dict(ckpt['model'])
        optimizer.load_state_dict(ckpt['optimizer'])
        lr_scheduler.load_state_dict(ckpt['lr_scheduler'])
        start_epoch = ckpt['epoch'] + 1

    start_time = time.time()
    for epoch in range(start_epoch, args.epochs):
        if args.distributed:
            sampler_train.set_epoch(epoch)
        train_stats = train_one_epoch(model, criterion, loader_train, optimizer, device, epoch, args.clip_max_norm)
        lr_scheduler.step()
        test_stats = evaluate(model, loader_val, dataset_val.coco, device)
        if is_main_process():
            torch.save({'model': model_without_ddp.state_dict(), 'optimizer': optimizer.state_dict(),
                        'lr_scheduler': lr_scheduler.state_dict(), 'epoch': epoch, 'args': args}, ckpt_file)
            with open(os.path.join(args.output_dir, 'log.txt'), 'a') as f:
                f.write(json.dumps({'epoch': epoch, **train_stats, **test_stats}) + '\n')
    print('Training time {}'.format(str(datetime.timedelta(seconds=int(time.time() - start_time)))))
    if args.distributed:
        dist.destroy_process_group()


if __name__ == '__main__':
    parser = argparse.ArgumentParser('YOLOS fine-tuning')
    parser.add_argument('--backbone', default='vit_small_patch16_224.augreg_in21k_ft_in1k')
    parser.add_argument('--data_path', default='data/crowdhuman')
    parser.add_argument('--num_classes', default=2, type=int)
    parser.add_argument('--det_token_num', default=100, type=int)
    parser.add_argument('--lr', default=5e-5, type=float)
    parser.add_argument('--weight_decay', default=1e-4, type=float)
    parser.add_argument('--batch_size', default=2, type=int)
    parser.add_argument('--epochs', default=150, type=int)
    parser.add_argument('--lr_drop', default=100, type=int)
    parser.add_argument('--clip_max_norm', default=0.1, type=float)
    parser.add_argument('--num_workers', default=4, type=int)
    parser.add_argument('--seed', default=42, type=int)
    parser.add_argument('--output_dir', default='outputs/yolos_s_crowdhuman')
    args = parser.parse_args()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
