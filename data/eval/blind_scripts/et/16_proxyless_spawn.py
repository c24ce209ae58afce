"""ProxylessNAS-style search with path binarisation (one active path per
mixed op), launched like the PyTorch ImageNet example: one process per GPU
via torch.multiprocessing, optionally over several nodes.

    python 16_proxyless_spawn.py /datasets/imagenet --dist-url tcp://127.0.0.1:23456 \
        --world-size 1 --rank 0 --multiprocessing-distributed
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.transforms as transforms

from proxyless.ops import MBInvertedConvLayer, ZeroLayer, ConvBN, LinearHead
from proxyless.latency import LatencyEstimator

CANDIDATES = ["3x3_MBConv3", "3x3_MBConv6", "5x5_MBConv3", "5x5_MBConv6", "7x7_MBConv3", "7x7_MBConv6"]
STAGES = [(24, 4, 2), (40, 4, 2), (80, 4, 2), (96, 4, 1), (192, 4, 2), (320, 1, 1)]

parser = argparse.ArgumentParser(description="ProxylessNAS search")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-j", "--workers", default=8, type=int)
parser.add_argument("--epochs", default=150, type=int)
parser.add_argument("--warmup-epochs", default=40, type=int, help="weights only")
parser.add_argument("-b", "--batch-size", default=512, type=int,
                    help="total batch size over all GPUs of all nodes")
parser.add_argument("--lr", default=0.05, type=float, help="for the total batch size")
parser.add_argument("--arch-lr", default=1e-3, type=float)
parser.add_argument("--grad-reg-loss-lambda", default=0.1, type=float)
parser.add_argument("--target-latency", default=80.0, type=float)
parser.add_argument("--world-size", default=-1, type=int, help="number of nodes")
parser.add_argument("--rank", default=-1, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--multiprocessing-distributed", action="store_true")
parser.add_argument("--seed", default=0, type=int)
parser.add_argument("--save", default="./proxyless_out")


class MixedEdge(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        ops = [MBInvertedConvLayer.from_name(n, cin, cout, stride) for n in CANDIDATES]
        if stride == 1 and cin == cout:
            ops.append(ZeroLayer())
        self.candidate_ops = nn.ModuleList(ops)
        self.alpha = nn.Parameter(torch.zeros(len(ops)))
        self.active = 0

    def forward(self, x):
        probs = F.softmax(self.alpha, dim=0)
        gate = 1.0 - probs[self.active].detach() + probs[self.active]   # straight-through binary gate
        return gate * self.candidate_ops[self.active](x)


class ProxylessSuperNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.first_conv = ConvBN(3, 32, 3, 2)
        self.first_block = MBInvertedConvLayer.from_name("3x3_MBConv1", 32, 16, 1)
        edges, cin = [], 16
        for cout, n, s in STAGES:
            for i in range(n):
                edges.append(MixedEdge(cin, cout, s if i == 0 else 1))
                cin = cout
        self.edges = nn.ModuleList(edges)
        self.head = LinearHead(cin, 1280, num_classes)

    def binarize(self, gen):
        for e in self.edges:
            probs = F.softmax(e.alpha.detach().float().cpu(), dim=0)
            e.active = int(torch.multinomial(probs, 1, generator=gen))

    def arch_parameters(self):
        return [e.alpha for e in self.edges]

    def weight_parameters(self):
        ids = {id(p) for p in self.arch_parameters()}
        return [p for p in self.parameters() if id(p) not in ids]

    def forward(self, x):
        x = self.first_block(self.first_conv(x))
        for e in self.edges:
            x = e(x)
        return self.head(x)


def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(args))
    else:
        # single process on GPU 0
        args.world_size, args.rank = 1, 0
        main_worker(0, args)


def main_worker(gpu, args):
    ngpus_per_node = torch.cuda.device_count()
    if args.multiprocessing_distributed:
        args.rank = args.rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    world = dist.get_world_size()
    batch_per_gpu = args.batch_size // world
    workers = (args.workers + ngpus_per_node - 1) // ngpus_per_node
    torch.manual_seed(args.seed)

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    full = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    # 50k held-out training images drive the architecture updates
    perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_set = torch.utils.data.Subset(full, perm[50000:])
    valid_set = torch.utils.data.Subset(full, perm[:50000])
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set)
    valid_sampler = torch.utils.data.distributed.DistributedSampler(valid_set)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=batch_per_gpu, sampler=train_sampler,
                                               num_workers=workers, pin_memory=True, drop_last=True)
    valid_loader = torch.utils.data.DataLoader(valid_set, batch_size=batch_per_gpu, sampler=valid_sampler,
                                               num_workers=workers, pin_memory=True, drop_last=True)

    net = ProxylessSuperNet().cuda(gpu)
    model = nn.parallel.DistributedDataParallel(net, device_ids=[gpu], find_unused_parameters=True)
    latency = LatencyEstimator("proxyless/latency_tables/mobile.yaml")
    w_opt = torch.optim.SGD(net.weight_parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=4e-5)
    a_opt = torch.optim.Adam(net.arch_parameters(), lr=args.arch_lr, betas=(0, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(w_opt, args.epochs * len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1).cuda(gpu)
    gen = torch.Generator()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        valid_sampler.set_epoch(epoch)
        valid_iter = iter(valid_loader)
        model.train()
        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            images, target = images.cuda(gpu, non_blocking=True), target.cuda(gpu, non_blocking=True)
            gen.manual_seed(args.seed * 1_000_003 + epoch * len(train_loader) + i)
            net.binarize(gen)
            w_opt.zero_grad()
            loss = criterion(model(images), target)
            loss.backward()
            w_opt.step()
            sched.step()

            if epoch >= args.warmup_epochs and i % 5 == 0:
                x_val, y_val = next(valid_iter, (None, None))
                if x_val is None:
                    valid_iter = iter(valid_loader)
                    x_val, y_val = next(valid_iter)
                x_val, y_val = x_val.cuda(gpu, non_blocking=True), y_val.cuda(gpu, non_blocking=True)
                net.binarize(gen)
                a_opt.zero_grad()
                exp_lat = latency.expected_latency(net)
                a_loss = criterion(model(x_val), y_val) * (exp_lat / args.target_latency) ** args.grad_reg_loss_lambda
                a_loss.backward()
                a_opt.step()
            if args.rank == 0 and i % 100 == 0:
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"time {time.time() - end:.1f}", flush=True)

        if args.rank == 0:
            os.makedirs(args.save, exist_ok=True)
            torch.save({"epoch": epoch, "state_dict": net.state_dict(), "w_opt": w_opt.state_dict(),
                        "a_opt": a_opt.state_dict()}, os.path.join(args.save, "checkpoint.pth.tar"))
            derived = [CANDIDATES[e.alpha.argmax().item()] if e.alpha.argmax().item() < len(CANDIDATES)
                       else "zero" for e in net.edges]
            print("derived:", derived, flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
