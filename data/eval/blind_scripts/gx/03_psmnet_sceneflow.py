"""PSMNet (stacked hourglass) training on SceneFlow with DDP.

torchrun --nproc_per_node=4 03_psmnet_sceneflow.py --datapath /data/sceneflow --savemodel ./ckpt/psmnet
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dataloader import listflowfile as lt
from dataloader import SecenFlowLoader as DA


def convbn(in_planes, out_planes, kernel_size, stride, pad, dilation):
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size=kernel_size, stride=stride,
                  padding=dilation if dilation > 1 else pad, dilation=dilation, bias=False),
        nn.BatchNorm2d(out_planes))


def convbn_3d(in_planes, out_planes, kernel_size, stride, pad):
    return nn.Sequential(
        nn.Conv3d(in_planes, out_planes, kernel_size=kernel_size, padding=pad, stride=stride, bias=False),
        nn.BatchNorm3d(out_planes))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride, downsample, pad, dilation):
        super().__init__()
        self.conv1 = nn.Sequential(convbn(inplanes, planes, 3, stride, pad, dilation), nn.ReLU(inplace=True))
        self.conv2 = convbn(planes, planes, 3, 1, pad, dilation)
        self.downsample = downsample

    def forward(self, x):
        out = self.conv2(self.conv1(x))
        if self.downsample is not None:
            x = self.downsample(x)
        return out + x


class FeatureExtraction(nn.Module):
    def __init__(self):
        super().__init__()
        self.inplanes = 32
        self.firstconv = nn.Sequential(convbn(3, 32, 3, 2, 1, 1), nn.ReLU(inplace=True),
                                       convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True),
                                       convbn(32, 32, 3, 1, 1, 1), nn.ReLU(inplace=True))
        self.layer1 = self._make_layer(32, 3, 1, 1, 1)
        self.layer2 = self._make_layer(64, 16, 2, 1, 1)
        self.layer3 = self._make_layer(128, 3, 1, 1, 1)
        self.layer4 = self._make_layer(128, 3, 1, 1, 2)
        self.branches = nn.ModuleList([
            nn.Sequential(nn.AvgPool2d((s, s), stride=(s, s)), convbn(128, 32, 1, 1, 0, 1), nn.ReLU(inplace=True))
            for s in (64, 32, 16, 8)])
        self.lastconv = nn.Sequential(convbn(320, 128, 3, 1, 1, 1), nn.ReLU(inplace=True),
                                      nn.Conv2d(128, 32, kernel_size=1, padding=0, stride=1, bias=False))

    def _make_layer(self, planes, blocks, stride, pad, dilation):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample, pad, dilation)]
        self.inplanes = planes
        for _ in range(1, blocks):
            layers.append(BasicBlock(self.inplanes, planes, 1, None, pad, dilation))
        return nn.Sequential(*layers)

    def forward(self, x):
        output = self.firstconv(x)
        output = self.layer1(output)
        output_raw = self.layer2(output)
        output = self.layer3(output_raw)
        output_skip = self.layer4(output)
        size = output_skip.shape[2:]
        pooled = [F.interpolate(b(output_skip), size, mode="bilinear", align_corners=False) for b in self.branches]
        feature = torch.cat([output_raw, output_skip] + pooled[::-1], 1)
        return self.lastconv(feature)


class Hourglass(nn.Module):
    def __init__(self, inplanes):
        super().__init__()
        self.conv1 = nn.Sequential(convbn_3d(inplanes, inplanes * 2, 3, 2, 1), nn.ReLU(inplace=True))
        self.conv2 = convbn_3d(inplanes * 2, inplanes * 2, 3, 1, 1)
        self.conv3 = nn.Sequential(convbn_3d(inplanes * 2, inplanes * 2, 3, 2, 1), nn.ReLU(inplace=True))
        self.conv4 = nn.Sequential(convbn_3d(inplanes * 2, inplanes * 2, 3, 1, 1), nn.ReLU(inplace=True))
        self.conv5 = nn.Sequential(nn.ConvTranspose3d(inplanes * 2, inplanes * 2, 3, padding=1, output_padding=1,
                                                      stride=2, bias=False), nn.BatchNorm3d(inplanes * 2))
        self.conv6 = nn.Sequential(nn.ConvTranspose3d(inplanes * 2, inplanes, 3, padding=1, output_padding=1,
                                                      stride=2, bias=False), nn.BatchNorm3d(inplanes))

    def forward(self, x, presqu, postsqu):
        out = self.conv1(x)
        pre = self.conv2(out)
        pre = F.relu(pre + postsqu, inplace=True) if postsqu is not None else F.relu(pre, inplace=True)
        out = self.conv3(pre)
        out = self.conv4(out)
        if presqu is not None:
            post = F.relu(self.conv5(out) + presqu, inplace=True)
        else:
            post = F.relu(self.conv5(out) + pre, inplace=True)
        out = self.conv6(post)
        return out, pre, post


class PSMNet(nn.Module):
    def __init__(self, maxdisp):
        super().__init__()
        self.maxdisp = maxdisp
        self.feature_extraction = FeatureExtraction()
        self.dres0 = nn.Sequential(convbn_3d(64, 32, 3, 1, 1), nn.ReLU(inplace=True),
                                   convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True))
        self.dres1 = nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True), convbn_3d(32, 32, 3, 1, 1))
        self.dres2, self.dres3, self.dres4 = Hourglass(32), Hourglass(32), Hourglass(32)
        self.classif = nn.ModuleList([
            nn.Sequential(convbn_3d(32, 32, 3, 1, 1), nn.ReLU(inplace=True),
                          nn.Conv3d(32, 1, kernel_size=3, padding=1, stride=1, bias=False))
            for _ in range(3)])

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2.0 / n))
            elif isinstance(m, nn.Conv3d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.kernel_size[2] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2.0 / n))
            elif isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d)):
                m.weight.data.fill_(1)
                m.bias.data.zero_()

    def regress(self, cost, size):
        cost = F.interpolate(cost, [self.maxdisp, size[0], size[1]], mode="trilinear", align_corners=False)
        prob = F.softmax(torch.squeeze(cost, 1), dim=1)
        disp_values = torch.arange(self.maxdisp, device=prob.device, dtype=prob.dtype).view(1, -1, 1, 1)
        return torch.sum(prob * disp_values, 1)

    def forward(self, left, right):
        ref = self.feature_extraction(left)
        tgt = self.feature_extraction(right)
        b, c, h, w = ref.shape
        d = self.maxdisp // 4
        cost = ref.new_zeros(b, c * 2, d, h, w)
        for i in range(d):
            if i > 0:
                cost[:, :c, i, :, i:] = ref[:, :, :, i:]
                cost[:, c:, i, :, i:] = tgt[:, :, :, :-i]
            else:
                cost[:, :c, i] = ref
                cost[:, c:, i] = tgt

        cost0 = self.dres0(cost)
        cost0 = self.dres1(cost0) + cost0
        out1, pre1, post1 = self.dres2(cost0, None, None)
        out1 = out1 + cost0
        out2, pre2, post2 = self.dres3(out1, pre1, post1)
        out2 = out2 + cost0
        out3, pre3, post3 = self.dres4(out2, pre1, post2)
        out3 = out3 + cost0

        cost1 = self.classif[0](out1)
        cost2 = self.classif[1](out2) + cost1
        cost3 = self.classif[2](out3) + cost2
        size = left.shape[2:]
        if self.training:
            return self.regress(cost1, size), self.regress(cost2, size), self.regress(cost3, size)
        return self.regress(cost3, size)


def parse_args():
    parser = argparse.ArgumentParser(description="PSMNet")
    parser.add_argument("--maxdisp", type=int, default=192, help="maxium disparity")
    parser.add_argument("--datapath", default="/data/sceneflow/", help="datapath")
    parser.add_argument("--epochs", type=int, default=10, help="number of epochs to train")
    parser.add_argument("--batch_size", type=int, default=2, help="images per GPU")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--loadmodel", default=None, help="load model")
    parser.add_argument("--savemodel", default="./ckpt", help="save model")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    return parser.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    all_left_img, all_right_img, all_left_disp, test_left_img, test_right_img, test_left_disp = lt.dataloader(args.datapath)
    train_set = DA.myImageFloder(all_left_img, all_right_img, all_left_disp, True)
    test_set = DA.myImageFloder(test_left_img, test_right_img, test_left_disp, False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    # evaluation shards: every rank takes every world_size-th image, no padding
    test_idx = list(range(rank, len(test_set), world_size))
    TrainImgLoader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                                num_workers=args.workers, pin_memory=True, drop_last=True)
    TestImgLoader = DataLoader(torch.utils.data.Subset(test_set, test_idx), batch_size=4,
                               shuffle=False, num_workers=args.workers, drop_last=False)

    model = PSMNet(args.maxdisp).to(device)
    if args.loadmodel is not None:
        state_dict = torch.load(args.loadmodel, map_location="cpu")
        model.load_state_dict({k.replace("module.", "", 1): v for k, v in state_dict["state_dict"].items()})
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    if rank == 0:
        print("Number of model parameters: {}".format(sum(p.data.nelement() for p in model.parameters())))

    # lr is tuned for 4 GPUs x 2 images, rescale when the global batch is different
    lr = args.lr * (args.batch_size * world_size) / 8.0
    optimizer = optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))

    if rank == 0:
        os.makedirs(args.savemodel, exist_ok=True)

    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        total_train_loss = torch.zeros(2, device=device)
        start_full_time = time.time()
        for batch_idx, (imgL, imgR, disp_L) in enumerate(TrainImgLoader):
            imgL, imgR, disp_true = imgL.to(device), imgR.to(device), disp_L.to(device)
            mask = (disp_true < args.maxdisp) & (disp_true > 0)

            optimizer.zero_grad()
            output1, output2, output3 = model(imgL, imgR)
            loss = 0.5 * F.smooth_l1_loss(output1[mask], disp_true[mask], reduction="mean") \
                + 0.7 * F.smooth_l1_loss(output2[mask], disp_true[mask], reduction="mean") \
                + F.smooth_l1_loss(output3[mask], disp_true[mask], reduction="mean")
            loss.backward()
            optimizer.step()

            total_train_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and batch_idx % 100 == 0:
                print("Iter %d training loss = %.3f" % (batch_idx, loss.item()), flush=True)

        dist.all_reduce(total_train_loss)
        if rank == 0:
            print("epoch %d total training loss = %.3f, time = %.2f h" % (
                epoch, (total_train_loss[0] / total_train_loss[1]).item(), (time.time() - start_full_time) / 3600))
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "train_loss": (total_train_loss[0] / total_train_loss[1]).item()},
                       os.path.join(args.savemodel, "checkpoint_%d.tar" % epoch))

        # ------------- TEST ------------------------------------------------------------
        model.eval()
        err = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for imgL, imgR, disp_L in TestImgLoader:
                imgL, imgR, disp_true = imgL.to(device), imgR.to(device), disp_L.to(device)
                # pad to a multiple of 16
                h, w = imgL.shape[2:]
                ph, pw = (16 - h % 16) % 16, (16 - w % 16) % 16
                imgL = F.pad(imgL, (0, pw, ph, 0))
                imgR = F.pad(imgR, (0, pw, ph, 0))
                output3 = model.module(imgL, imgR)
                output3 = output3[:, ph:, :w] if ph else output3[:, :, :w]
                mask = (disp_true < args.maxdisp) & (disp_true > 0)
                err[0] += (output3[mask] - disp_true[mask]).abs().sum()
                err[1] += mask.sum()
        dist.all_reduce(err)
        if rank == 0:
            print("epoch %d test EPE = %.4f" % (epoch, (err[0] / err[1].clamp(min=1)).item()), flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
