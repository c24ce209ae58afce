#!/usr/bin/env python
# Space-Time Memory network, main training stage (DAVIS-17 + YouTube-VOS), single node.
#
#   CUDA_VISIBLE_DEVICES=0,1,2,3 python train_stm.py --davis /data/DAVIS2017 --youtube /data/ytvos18/train
from __future__ import division

import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as models
from PIL import Image
from torch.utils import data
from torch.utils.tensorboard import SummaryWriter
from torchvision.ops import FrozenBatchNorm2d


def get_arguments():
    parser = argparse.ArgumentParser(description="STM main training")
    parser.add_argument("--davis", type=str, required=True)
    parser.add_argument("--youtube", type=str, required=True)
    parser.add_argument("--pretrained", type=str, default="weights/stm_static_pretrain.pth")
    parser.add_argument("--save", type=str, default="weights/main")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=260000)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--max_skip", type=int, default=25)
    parser.add_argument("--eval_every", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=16)
    return parser.parse_args()


def ToCuda(xs):
    if torch.cuda.is_available():
        if isinstance(xs, (list, tuple)):
            return [x.cuda(non_blocking=True) for x in xs]
        return xs.cuda(non_blocking=True)
    return xs


class VOSTriplets(data.Dataset):
    K = 11

    def __init__(self, img_root, mask_root, max_skip, size=384):
        self.img_root, self.mask_root, self.size = img_root, mask_root, size
        self.max_skip = max_skip
        self.videos = sorted(os.listdir(mask_root))
        self.masks = {v: sorted(os.listdir(os.path.join(mask_root, v))) for v in self.videos}

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, index):
        video = self.videos[index]
        names = self.masks[video]
        n = len(names)
        skip = random.randint(0, self.max_skip)
        f1 = random.randint(0, max(0, n - 3 - 2 * skip))
        ids = [f1, min(n - 1, f1 + skip + 1), min(n - 1, f1 + 2 * skip + 2)]
        Fs = np.empty((3, self.size, self.size, 3), dtype=np.float32)
        Ms = np.empty((3, self.size, self.size), dtype=np.uint8)
        for i, f in enumerate(ids):
            img = Image.open(os.path.join(self.img_root, video, names[f][:-4] + ".jpg")).convert("RGB")
            msk = Image.open(os.path.join(self.mask_root, video, names[f])).convert("P")
            Fs[i] = np.asarray(img.resize((self.size, self.size), Image.BILINEAR)) / 255.0
            Ms[i] = np.asarray(msk.resize((self.size, self.size), Image.NEAREST))
        objs = [o for o in np.unique(Ms[0]) if o != 0][:3]
        oh = np.zeros((self.K, 3, self.size, self.size), dtype=np.float32)
        for k, o in enumerate(objs, start=1):
            oh[k] = Ms == o
        oh[0] = 1 - oh[1:].sum(0).clip(0, 1)
        Fs = (Fs - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
        return torch.from_numpy(Fs.transpose(3, 0, 1, 2).astype(np.float32)), torch.from_numpy(oh), torch.LongTensor([len(objs)])


def resnet50_frozen():
    return models.resnet50(weights="IMAGENET1K_V1", norm_layer=FrozenBatchNorm2d)


class Encoder(nn.Module):
    def __init__(self, in_extra):
        super().__init__()
        r = resnet50_frozen()
        self.conv1, self.bn1, self.relu, self.maxpool = r.conv1, r.bn1, r.relu, r.maxpool
        self.res2, self.res3, self.res4 = r.layer1, r.layer2, r.layer3
        self.in_extra = in_extra
        if in_extra:
            self.conv1_extra = nn.Conv2d(in_extra, 64, 7, 2, 3, bias=False)
        self.register_buffer("mean", torch.FloatTensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))

    def forward(self, f, *extra):
        x = self.conv1(f)
        if self.in_extra:
            x = x + self.conv1_extra(torch.stack(extra, 1).float())
        c1 = self.relu(self.bn1(x))
        r2 = self.res2(self.maxpool(c1))
        r3 = self.res3(r2)
        r4 = self.res4(r3)
        return r4, r3, r2


class KeyValue(nn.Module):
    def __init__(self, indim, keydim, valdim):
        super().__init__()
        self.Key = nn.Conv2d(indim, keydim, 3, padding=1)
        self.Value = nn.Conv2d(indim, valdim, 3, padding=1)

    def forward(self, x):
        return self.Key(x), self.Value(x)


class Decoder(nn.Module):
    def __init__(self, mdim):
        super().__init__()
        self.convFM = nn.Conv2d(1024, mdim, 3, padding=1)
        self.RF3 = nn.Conv2d(512 + mdim, mdim, 3, padding=1)
        self.RF2 = nn.Conv2d(256 + mdim, mdim, 3, padding=1)
        self.pred2 = nn.Conv2d(mdim, 2, 3, padding=1)

    def forward(self, r4, r3, r2):
        m4 = F.relu(self.convFM(r4))
        m3 = F.relu(self.RF3(torch.cat([r3, F.interpolate(m4, scale_factor=2, mode="bilinear", align_corners=False)], 1)))
        m2 = F.relu(self.RF2(torch.cat([r2, F.interpolate(m3, scale_factor=2, mode="bilinear", align_corners=False)], 1)))
        return F.interpolate(self.pred2(F.relu(m2)), scale_factor=4, mode="bilinear", align_corners=False)


class STM(nn.Module):
    def __init__(self):
        super().__init__()
        self.Encoder_M = Encoder(in_extra=2)
        self.Encoder_Q = Encoder(in_extra=0)
        self.KV_M_r4 = KeyValue(1024, keydim=128, valdim=512)
        self.KV_Q_r4 = KeyValue(1024, keydim=128, valdim=512)
        self.Decoder = Decoder(256)
        self.reset_memory()

    def reset_memory(self):
        self.keys, self.values = None, None

    def memorize(self, frame, masks, num_objects):
        # frame: B 3 H W, masks: B K H W (K includes background)
        B, K = masks.shape[:2]
        fs, ms, os_ = [], [], []
        for o in range(1, K):
            fs.append(frame)
            ms.append(masks[:, o])
            os_.append(torch.clamp(masks[:, 1:].sum(1) - masks[:, o], 0, 1))
        r4, _, _ = self.Encoder_M(torch.cat(fs), torch.cat(ms), torch.cat(os_))
        k4, v4 = self.KV_M_r4(r4)
        k4 = k4.view(K - 1, B, *k4.shape[1:]).transpose(0, 1).unsqueeze(3)   # B K-1 C 1 H W
        v4 = v4.view(K - 1, B, *v4.shape[1:]).transpose(0, 1).unsqueeze(3)
        if self.keys is None:
            self.keys, self.values = k4, v4
        else:
            self.keys, self.values = torch.cat([self.keys, k4], 3), torch.cat([self.values, v4], 3)

    def segment(self, frame, num_objects):
        B = frame.shape[0]
        K = self.keys.shape[1] + 1
        r4, r3, r2 = self.Encoder_Q(frame)
        k4, v4 = self.KV_Q_r4(r4)
        logits = []
        for o in range(K - 1):
            mk = self.keys[:, o].flatten(2)                      # B C THW
            mv = self.values[:, o].flatten(2)
            p = torch.bmm(mk.transpose(1, 2), k4.flatten(2)) / math.sqrt(mk.shape[1])
            p = F.softmax(p, dim=1)
            mem = torch.bmm(mv, p).view_as(v4)
            logits.append(self.Decoder(torch.cat([mem, v4], 1), r3, r2))
        ps = torch.stack([F.softmax(l, 1)[:, 1] for l in logits], 1)
        valid = (torch.arange(K - 1, device=frame.device)[None] < num_objects.view(B, 1)).float()[..., None, None]
        ps = ps * valid
        em = torch.cat([torch.prod(1 - ps, 1, keepdim=True), ps], 1).clamp(1e-7, 1 - 1e-7)
        return torch.log(em / (1 - em))

    def forward(self, *args, mode="segment"):
        if mode == "memorize":
            return self.memorize(*args)
        return self.segment(*args)


def iou(pred, gt):
    inter = (pred & gt).sum()
    union = (pred | gt).sum()
    return 1.0 if union == 0 else float(inter) / float(union)


def evaluate(net, davis_root, max_seqs=None):
    """J (region) on DAVIS-17 val, single GPU."""
    with open(os.path.join(davis_root, "ImageSets/2017/val.txt")) as f:
        seqs = [s.strip() for s in f if s.strip()][:max_seqs]
    net.eval()
    scores = []
    with torch.no_grad():
        for seq in seqs:
            names = sorted(os.listdir(os.path.join(davis_root, "JPEGImages/480p", seq)))
            gts = [np.asarray(Image.open(os.path.join(davis_root, "Annotations/480p", seq, n[:-4] + ".png"))) for n in names]
            objs = [o for o in np.unique(gts[0]) if o != 0]
            K = 11
            oh0 = torch.zeros(1, K, *gts[0].shape)
            for o in objs:
                oh0[0, o] = torch.from_numpy(gts[0] == o)
            oh0[0, 0] = 1 - oh0[0, 1:].sum(0).clamp(0, 1)
            n_obj = torch.LongTensor([len(objs)]).cuda()
            net.reset_memory()
            frames = [torch.from_numpy(((np.asarray(Image.open(os.path.join(davis_root, "JPEGImages/480p", seq, n)).convert("RGB")) / 255.0
                                          - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]).transpose(2, 0, 1).astype(np.float32))[None].cuda()
                      for n in names]
            net.memorize(frames[0], oh0.cuda(), n_obj)
            for t in range(1, len(names)):
                logit = net.segment(frames[t], n_obj)
                pred = logit.argmax(1)[0].cpu().numpy()
                scores.extend(iou(pred == o, gts[t] == o) for o in objs)
                if t % 5 == 0:
                    net.memorize(frames[t], F.softmax(logit, 1), n_obj)
    net.train()
    return float(np.mean(scores))


def main():
    args = get_arguments()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    os.makedirs(args.save, exist_ok=True)
    writer = SummaryWriter(os.path.join(args.save, "logs"))

    ds = data.ConcatDataset(
        [VOSTriplets(os.path.join(args.davis, "JPEGImages/480p"), os.path.join(args.davis, "Annotations/480p"), args.max_skip)] * 5
        + [VOSTriplets(os.path.join(args.youtube, "JPEGImages"), os.path.join(args.youtube, "Annotations"), args.max_skip)])
    loader = data.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)

    stm = STM()
    if os.path.isfile(args.pretrained):
        stm.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    model = nn.DataParallel(stm).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()

    it, best = 0, 0.0
    tic = time.time()
    while it < args.iters:
        for Fs, Ms, num_objects in loader:
            Fs, Ms, num_objects = ToCuda([Fs, Ms, num_objects])
            model.module.reset_memory()
            model(Fs[:, :, 0], Ms[:, :, 0], num_objects, mode="memorize")
            logit1 = model(Fs[:, :, 1], num_objects, mode="segment")
            model(Fs[:, :, 1], F.softmax(logit1, 1), num_objects, mode="memorize")
            logit2 = model(Fs[:, :, 2], num_objects, mode="segment")
            loss = criterion(logit1, Ms[:, :, 1].argmax(1)) + criterion(logit2, Ms[:, :, 2].argmax(1))

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            it += 1
            if it % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                print("iter {} loss {:.4f} ({:.2f}s/it)".format(it, loss.item(), (time.time() - tic) / 100))
                tic = time.time()
            if it % args.eval_every == 0:
                j = evaluate(model.module, args.davis)
                writer.add_scalar("val/J", j, it)
                print("iter {} DAVIS17 val J {:.4f}".format(it, j))
                torch.save(model.module.state_dict(), os.path.join(args.save, "stm_{}.pth".format(it)))
                if j > best:
                    best = j
                    torch.save(model.module.state_dict(), os.path.join(args.save, "stm_best.pth"))
            if it >= args.iters:
                break
    writer.close()


if __name__ == "__main__":
    main()
