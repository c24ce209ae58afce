"""GwcNet-gc training on SceneFlow, one process per GPU via torch.multiprocessing.

    python 08_gwcnet_stereo.py --datapath /data/SceneFlow --trainlist filenames/sceneflow_train.txt \
        --testlist filenames/sceneflow_test.txt --logdir ./checkpoints/sceneflow/gwcnet-gc
"""
from __future__ import print_function, division

import argparse
import gc
import os
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tensorboardX import SummaryWriter

from datasets import __datasets__
from models import __models__, model_loss
from utils import adjust_learning_rate, D1_metric, EPE_metric, Thres_metric, tensor2float

cudnn.benchmark = True


def get_parser():
    parser = argparse.ArgumentParser(description="Group-wise Correlation Stereo Network (GwcNet)")
    parser.add_argument("--model", default="gwcnet-gc", help="select a model structure", choices=__models__.keys())
    parser.add_argument("--maxdisp", type=int, default=192, help="maximum disparity")
    parser.add_argument("--dataset", default="sceneflow", help="dataset name", choices=__datasets__.keys())
    parser.add_argument("--datapath", required=True, help="data path")
    parser.add_argument("--trainlist", required=True, help="training list")
    parser.add_argument("--testlist", required=True, help="testing list")
    parser.add_argument("--lr", type=float, default=0.001, help="base learning rate")
    parser.add_argument("--batch_size", type=int, default=4, help="training batch size per GPU (base lr is for 4 GPUs)")
    parser.add_argument("--test_batch_size", type=int, default=4, help="testing batch size per GPU")
    parser.add_argument("--epochs", type=int, default=16, help="number of epochs to train")
    parser.add_argument("--lrepochs", type=str, default="10,12,14,16:2", help="the epochs to decay lr: the downscale rate")
    parser.add_argument("--logdir", required=True, help="the directory to save logs and checkpoints")
    parser.add_argument("--loadckpt", help="load the weights from a specific checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue training the model")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    parser.add_argument("--summary_freq", type=int, default=20, help="the frequency of saving summary")
    parser.add_argument("--save_freq", type=int, default=1, help="the frequency of saving checkpoint")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--port", type=int, default=29511)
    return parser


def reduce_scalars(scalars, world_size, device):
    keys = sorted(scalars)
    t = torch.tensor([float(scalars[k]) for k in keys], device=device, dtype=torch.float64)
    dist.all_reduce(t)
    t /= world_size
    return {k: v for k, v in zip(keys, t.tolist())}


def train_sample(model, optimizer, sample, device):
    model.train()
    imgL, imgR, disp_gt = sample["left"], sample["right"], sample["disparity"]
    imgL = imgL.to(device, non_blocking=True)
    imgR = imgR.to(device, non_blocking=True)
    disp_gt = disp_gt.to(device, non_blocking=True)

    optimizer.zero_grad()
    disp_ests = model(imgL, imgR)
    mask = (disp_gt < model.module.maxdisp) & (disp_gt > 0)
    loss = model_loss(disp_ests, disp_gt, mask)
    loss.backward()
    optimizer.step()
    return loss.item(), EPE_metric(disp_ests[-1], disp_gt, mask).item()


@torch.no_grad()
def test_sample(net, sample, device):
    net.eval()
    imgL = sample["left"].to(device)
    imgR = sample["right"].to(device)
    disp_gt = sample["disparity"].to(device)
    disp_est = net(imgL, imgR)[-1]
    mask = (disp_gt < net.maxdisp) & (disp_gt > 0)
    n = float(imgL.shape[0])
    # the metrics are batch means; weight them by the batch size so they can be summed across ranks
    return torch.stack([
        EPE_metric(disp_est, disp_gt, mask).float() * n,
        D1_metric(disp_est, disp_gt, mask).float() * n,
        Thres_metric(disp_est, disp_gt, mask, 3.0).float() * n,
        torch.tensor(n, device=device),
    ]).double()


def main_worker(local_rank, ngpus, args):
    rank = local_rank
    world_size = ngpus
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=world_size, rank=rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    StereoDataset = __datasets__[args.dataset]
    train_dataset = StereoDataset(args.datapath, args.trainlist, True)
    test_dataset = StereoDataset(args.datapath, args.testlist, False)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, shuffle=True)
    TrainImgLoader = DataLoader(train_dataset, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                                drop_last=True, pin_memory=True)
    test_shard = Subset(test_dataset, range(rank, len(test_dataset), world_size))
    TestImgLoader = DataLoader(test_shard, args.test_batch_size, shuffle=False, num_workers=4, drop_last=False)

    model = __models__[args.model](args.maxdisp)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    start_epoch = 0
    optimizer_state = None
    if args.resume:
        all_saved_ckpts = [fn for fn in os.listdir(args.logdir) if fn.endswith(".ckpt")]
        all_saved_ckpts = sorted(all_saved_ckpts, key=lambda x: int(x.split("_")[-1].split(".")[0]))
        loadckpt = os.path.join(args.logdir, all_saved_ckpts[-1])
        # checkpoints are written from cuda:0, map them onto this process' GPU
        state_dict = torch.load(loadckpt, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.load_state_dict(state_dict["model"])
        optimizer_state = state_dict["optimizer"]
        start_epoch = state_dict["epoch"] + 1
    elif args.loadckpt:
        state_dict = torch.load(args.loadckpt, map_location="cpu")
        model.load_state_dict(state_dict["model"])

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)

    logger = None
    if rank == 0:
        os.makedirs(args.logdir, exist_ok=True)
        logger = SummaryWriter(args.logdir)
        print("start at epoch {}, world size {}".format(start_epoch, world_size))

    for epoch_idx in range(start_epoch, args.epochs):
        adjust_learning_rate(optimizer, epoch_idx, args.lr, args.lrepochs)
        train_sampler.set_epoch(epoch_idx)

        for batch_idx, sample in enumerate(TrainImgLoader):
            global_step = len(TrainImgLoader) * epoch_idx + batch_idx
            start_time = time.time()
            loss, epe = train_sample(model, optimizer, sample, device)
            if global_step % args.summary_freq == 0:
                scalars = reduce_scalars({"loss": loss, "EPE": epe}, world_size, device)
                if rank == 0:
                    for k, v in scalars.items():
                        logger.add_scalar("train/" + k, v, global_step)
                    print("Epoch {}/{}, Iter {}/{}, train loss = {:.3f}, time = {:.3f}".format(
                        epoch_idx, args.epochs, batch_idx, len(TrainImgLoader), scalars["loss"],
                        time.time() - start_time))

        if (epoch_idx + 1) % args.save_freq == 0:
            if rank == 0:
                checkpoint_data = {"epoch": epoch_idx, "model": model.module.state_dict(),
                                   "optimizer": optimizer.state_dict()}
                torch.save(checkpoint_data, "{}/checkpoint_{:0>6}.ckpt".format(args.logdir, epoch_idx))
            dist.barrier()
        gc.collect()

        # testing, every rank on its own slice of the test list
        totals = torch.zeros(4, device=device, dtype=torch.float64)
        for sample in TestImgLoader:
            totals += test_sample(model.module, sample, device)
        dist.all_reduce(totals)
        if rank == 0:
            n = totals[3].item()
            avg = {"EPE": totals[0].item() / n, "D1": totals[1].item() / n, "Thres3": totals[2].item() / n}
            for k, v in avg.items():
                logger.add_scalar("test/" + k, v, len(TrainImgLoader) * (epoch_idx + 1))
            print("avg_test_scalars", avg)
        gc.collect()

    if logger is not None:
        logger.close()
    dist.destroy_process_group()


def main():
    args = get_parser().parse_args()
    ngpus = torch.cuda.device_count()
    assert ngpus > 0, "no GPU found"
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args), join=True)


if __name__ == "__main__":
    main()
