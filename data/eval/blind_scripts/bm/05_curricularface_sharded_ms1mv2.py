"""CurricularFace on MS1MV2 (85,742 identities) with the classifier split over GPUs.

    torchrun --nproc_per_node=8 05_curricularface_sharded_ms1mv2.py --config configs/ms1mv2_r100.yaml
"""
import argparse
import logging
import math
import numbers
import os
import time

import mxnet as mx
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from backbones import get_model  # insightface recognition backbones (iresnet50/100/200)

DEFAULTS = dict(
    rec="/data/faces_emore", num_classes=85742, network="r100", embedding_size=512,
    batch_size=128, lr=0.1, momentum=0.9, weight_decay=5e-4, num_epoch=24,
    decay_epoch=[10, 18, 22], margin=0.5, scale=64.0, fp16=True,
    output="/shared/exp/ms1mv2_curricular", num_workers=4, frequent=50,
)


class MXFaceDataset(Dataset):
    def __init__(self, root_dir):
        self.transform = transforms.Compose([
            transforms.ToPILImage(), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
            transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])])
        self.imgrec = mx.recordio.MXIndexedRecordIO(os.path.join(root_dir, "train.idx"),
                                                    os.path.join(root_dir, "train.rec"), "r")
        header, _ = mx.recordio.unpack(self.imgrec.read_idx(0))
        self.imgidx = np.array(range(1, int(header.label[0])))

    def __getitem__(self, index):
        header, img = mx.recordio.unpack(self.imgrec.read_idx(int(self.imgidx[index])))
        label = header.label
        if not isinstance(label, numbers.Number):
            label = label[0]
        return self.transform(mx.image.imdecode(img).asnumpy()), torch.tensor(label, dtype=torch.long)

    def __len__(self):
        return len(self.imgidx)


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


class ShardedCurricularFace(nn.Module):
    """Each rank keeps the class centres [class_start, class_start + num_local)."""

    def __init__(self, in_features, num_classes, s=64.0, m=0.5):
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        base, extra = divmod(num_classes, world)
        self.num_local = base + (1 if rank < extra else 0)
        self.class_start = base * rank + min(rank, extra)
        self.s, self.m = s, m
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.threshold = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m
        self.kernel = nn.Parameter(torch.normal(0, 0.01, (self.num_local, in_features)))
        self.register_buffer("t", torch.zeros(1))

    def forward(self, embeddings, labels):
        # embeddings / labels are the gathered global batch
        B = embeddings.size(0)
        local = (labels >= self.class_start) & (labels < self.class_start + self.num_local)
        idx = torch.where(local)[0]
        local_label = labels[idx] - self.class_start

        cos_theta = F.linear(F.normalize(embeddings), F.normalize(self.kernel)).clamp(-1, 1)
        with torch.no_grad():
            target = torch.zeros(B, device=embeddings.device)
            target[idx] = cos_theta[idx, local_label]
            dist.all_reduce(target)
            self.t = target.mean().unsqueeze(0) * 0.01 + 0.99 * self.t
            sin_t = torch.sqrt((1.0 - target ** 2).clamp(min=1e-6))
            cos_theta_m = target * self.cos_m - sin_t * self.sin_m
            mask = cos_theta > cos_theta_m.unsqueeze(1)
        hard = cos_theta[mask]
        cos_theta = cos_theta.clone()
        cos_theta[mask] = hard * (self.t + hard)

        tgt = cos_theta[idx, local_label]
        sin_tgt = torch.sqrt((1.0 - tgt ** 2).clamp(min=1e-6))
        phi = tgt * self.cos_m - sin_tgt * self.sin_m
        phi = torch.where(tgt > self.threshold, phi, tgt - self.mm)
        cos_theta[idx, local_label] = phi
        return cos_theta * self.s, idx, local_label


class ShardedSoftmaxCE(torch.autograd.Function):
    """Cross entropy over logits whose class dimension is split across ranks."""

    @staticmethod
    def forward(ctx, logits, idx, local_label):
        B = logits.size(0)
        logits = logits.detach().clone()
        max_logit = logits.max(dim=1, keepdim=True).values
        dist.all_reduce(max_logit, op=dist.ReduceOp.MAX)
        logits.sub_(max_logit).exp_()
        sum_exp = logits.sum(dim=1, keepdim=True)
        dist.all_reduce(sum_exp)
        logits.div_(sum_exp)
        prob = torch.zeros(B, 1, device=logits.device)
        prob[idx] = logits[idx, local_label].unsqueeze(1)
        dist.all_reduce(prob)
        ctx.save_for_backward(logits, idx, local_label)
        return -prob.clamp_min(1e-30).log().mean()

    @staticmethod
    def backward(ctx, grad_output):
        softmax, idx, local_label = ctx.saved_tensors
        grad = softmax.clone()
        grad[idx, local_label] -= 1.0
        grad.div_(softmax.size(0))
        return grad * grad_output, None, None


class FaceRecognizer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.backbone = get_model(cfg["network"], dropout=0.0, fp16=cfg["fp16"],
                                  num_features=cfg["embedding_size"])
        self.head = ShardedCurricularFace(cfg["embedding_size"], cfg["num_classes"],
                                          s=cfg["scale"], m=cfg["margin"])

    def forward(self, images, labels):
        local_emb = self.backbone(images).float()
        embeddings = torch.cat(GatherLayer.apply(local_emb))
        all_labels = [torch.zeros_like(labels) for _ in range(dist.get_world_size())]
        dist.all_gather(all_labels, labels)
        return self.head(embeddings, torch.cat(all_labels))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(cfg["output"], exist_ok=True)

    dataset = MXFaceDataset(cfg["rec"])
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=sampler,
                        num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)

    model = FaceRecognizer(cfg).cuda()
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

    lr = cfg["lr"] * cfg["batch_size"] * world_size / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg["momentum"],
                                weight_decay=cfg["weight_decay"])
    milestones = [e * len(loader) for e in cfg["decay_epoch"]]
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=0.1)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["fp16"])

    global_step = 0
    for epoch in range(cfg["num_epoch"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (img, label) in enumerate(loader):
            img, label = img.cuda(non_blocking=True), label.cuda(non_blocking=True)
            logits, idx, local_label = model(img, label)
            loss = ShardedSoftmaxCE.apply(logits, idx, local_label)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.module.backbone.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            global_step += 1
            if global_step % cfg["frequent"] == 0:
                throughput = cfg["frequent"] * cfg["batch_size"] * world_size / (time.time() - tic)
                tic = time.time()
                logging.info("epoch %d step %d loss %.4f lr %.5f t %.4f %.0f samples/s", epoch, step,
                             loss.item(), scheduler.get_last_lr()[0],
                             model.module.head.t.item(), throughput)

        torch.save(model.module.head.state_dict(),
                   os.path.join(cfg["output"], f"head_rank{rank:02d}.pt"))
        if rank == 0:
            torch.save(model.module.backbone.state_dict(), os.path.join(cfg["output"], "backbone.pth"))
            logging.info("saved epoch %d", epoch)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
