# PointNet++ (SSG) classification on ModelNet40, DDP version of our single-GPU train_cls.py
#
#   torchrun --nproc_per_node=4 07_pointnet2_modelnet.py --log_dir pn2_ssg_ddp --batch_size 16
#
import os
import sys
import argparse
import datetime
import logging

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

BASE_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(BASE_DIR, 'models'))
from data_utils.ModelNetDataLoader import ModelNetDataLoader  # noqa: E402
from pointnet2_utils import PointNetSetAbstraction  # noqa: E402
import provider  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser('PointNet++ cls')
    parser.add_argument('--local_rank', type=int, default=0)
    parser.add_argument('--batch_size', type=int, default=16, help='batch size per gpu')
    parser.add_argument('--epoch', default=200, type=int)
    parser.add_argument('--learning_rate', default=0.001, type=float)
    parser.add_argument('--num_point', type=int, default=1024)
    parser.add_argument('--num_category', default=40, type=int, choices=[10, 40])
    parser.add_argument('--log_dir', type=str, default=None)
    parser.add_argument('--decay_rate', type=float, default=1e-4)
    parser.add_argument('--use_normals', action='store_true', default=False)
    parser.add_argument('--process_data', action='store_true', default=False)
    parser.add_argument('--use_uniform_sample', action='store_true', default=False)
    parser.add_argument('--data_path', type=str, default='data/modelnet40_normal_resampled/')
    return parser.parse_args()


class get_model(nn.Module):
    def __init__(self, num_class, normal_channel=True):
        super(get_model, self).__init__()
        in_channel = 6 if normal_channel else 3
        self.normal_channel = normal_channel
        self.sa1 = PointNetSetAbstraction(npoint=512, radius=0.2, nsample=32, in_channel=in_channel,
                                          mlp=[64, 64, 128], group_all=False)
        self.sa2 = PointNetSetAbstraction(npoint=128, radius=0.4, nsample=64, in_channel=128 + 3,
                                          mlp=[128, 128, 256], group_all=False)
        self.sa3 = PointNetSetAbstraction(npoint=None, radius=None, nsample=None, in_channel=256 + 3,
                                          mlp=[256, 512, 1024], group_all=True)
        self.fc1 = nn.Linear(1024, 512)
        self.bn1 = nn.BatchNorm1d(512)
        self.drop1 = nn.Dropout(0.4)
        self.fc2 = nn.Linear(512, 256)
        self.bn2 = nn.BatchNorm1d(256)
        self.drop2 = nn.Dropout(0.4)
        self.fc3 = nn.Linear(256, num_class)

    def forward(self, xyz):
        B, _, _ = xyz.shape
        if self.normal_channel:
            norm = xyz[:, 3:, :]
            xyz = xyz[:, :3, :]
        else:
            norm = None
        l1_xyz, l1_points = self.sa1(xyz, norm)
        l2_xyz, l2_points = self.sa2(l1_xyz, l1_points)
        l3_xyz, l3_points = self.sa3(l2_xyz, l2_points)
        x = l3_points.view(B, 1024)
        x = self.drop1(F.relu(self.bn1(self.fc1(x))))
        x = self.drop2(F.relu(self.bn2(self.fc2(x))))
        x = F.log_softmax(self.fc3(x), -1)
        return x


def get_logger(log_dir, rank):
    logger = logging.getLogger('Model')
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if rank == 0:
        fh = logging.FileHandler(os.path.join(log_dir, 'train_cls.txt'))
        fh.setFormatter(logging.Formatter('%(asctime)s - %(message)s'))
        logger.addHandler(fh)
    return logger


@torch.no_grad()
def test(model, loader, num_class, device):
    # per-class correct / count, summed over ranks afterwards
    class_correct = torch.zeros(num_class, device=device)
    class_total = torch.zeros(num_class, device=device)
    classifier = model.eval()
    for points, target in loader:
        points, target = points.to(device), target.to(device).long()
        pred = classifier(points.transpose(2, 1)).argmax(1)
        class_total += torch.bincount(target, minlength=num_class).float()
        class_correct += torch.bincount(target[pred == target], minlength=num_class).float()
    dist.all_reduce(class_correct)
    dist.all_reduce(class_total)
    instance_acc = (class_correct.sum() / class_total.sum()).item()
    class_acc = (class_correct / class_total.clamp(min=1)).mean().item()
    return instance_acc, class_acc


def main(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend='nccl')
    rank = dist.get_rank()
    device = torch.device('cuda', args.local_rank)

    timestr = str(datetime.datetime.now().strftime('%Y-%m-%d_%H-%M'))
    exp_dir = os.path.join('log', 'classification', args.log_dir or timestr)
    ckpt_dir = os.path.join(exp_dir, 'checkpoints')
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    logger = get_logger(exp_dir, rank)
    logger.info(str(args))

    train_dataset = ModelNetDataLoader(root=args.data_path, args=args, split='train', process_data=args.process_data)
    test_dataset = ModelNetDataLoader(root=args.data_path, args=args, split='test', process_data=args.process_data)
    train_sampler = DistributedSampler(train_dataset, shuffle=True)
    # test set split without padding, counts are all-reduced in test()
    test_subset = torch.utils.data.Subset(test_dataset, range(rank, len(test_dataset), dist.get_world_size()))
    trainDataLoader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                                 num_workers=8, drop_last=True, pin_memory=True)
    testDataLoader = DataLoader(test_subset, batch_size=args.batch_size, shuffle=False, num_workers=8)

    classifier = get_model(args.num_category, normal_channel=args.use_normals)
    classifier = nn.SyncBatchNorm.convert_sync_batchnorm(classifier).to(device)
    criterion = nn.NLLLoss()

    start_epoch = 0
    if os.path.exists(os.path.join(ckpt_dir, 'best_model.pth')):
        checkpoint = torch.load(os.path.join(ckpt_dir, 'best_model.pth'), map_location=device)
        start_epoch = checkpoint['epoch'] + 1
        classifier.load_state_dict(checkpoint['model_state_dict'])
        logger.info('Use pretrain model')
    classifier = DistributedDataParallel(classifier, device_ids=[args.local_rank])

    optimizer = torch.optim.Adam(classifier.parameters(), lr=args.learning_rate, betas=(0.9, 0.999),
                                 eps=1e-08, weight_decay=args.decay_rate)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.7)
    for _ in range(start_epoch):
        scheduler.step()

    best_instance_acc, best_class_acc = 0.0, 0.0
    for epoch in range(start_epoch, args.epoch):
        logger.info('Epoch %d (%d/%s):' % (epoch + 1, epoch + 1, args.epoch))
        train_sampler.set_epoch(epoch)
        classifier.train()
        correct = torch.zeros(2, device=device)
        for points, target in tqdm(trainDataLoader, disable=rank != 0, smoothing=0.9):
            points = points.data.numpy()
            points = provider.random_point_dropout(points)
            points[:, :, 0:3] = provider.random_scale_point_cloud(points[:, :, 0:3])
            points[:, :, 0:3] = provider.shift_point_cloud(points[:, :, 0:3])
            points = torch.Tensor(points).transpose(2, 1).to(device, non_blocking=True)
            target = target.to(device, non_blocking=True).long()

            pred = classifier(points)
            loss = criterion(pred, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct[0] += (pred.argmax(1) == target).sum()
            correct[1] += target.numel()
        scheduler.step()
        dist.all_reduce(correct)
        logger.info('Train Instance Accuracy: %f' % (correct[0] / correct[1]).item())

        instance_acc, class_acc = test(classifier.module, testDataLoader, args.num_category, device)
        if instance_acc >= best_instance_acc:
            best_instance_acc = instance_acc
            best_epoch = epoch + 1
        best_class_acc = max(best_class_acc, class_acc)
        logger.info('Test Instance Accuracy: %f, Class Accuracy: %f' % (instance_acc, class_acc))
        logger.info('Best Instance Accuracy: %f, Class Accuracy: %f' % (best_instance_acc, best_class_acc))

        if rank == 0 and instance_acc >= best_instance_acc:
            savepath = os.path.join(ckpt_dir, 'best_model.pth')
            logger.info('Saving at %s' % savepath)
            torch.save({'epoch': best_epoch - 1, 'instance_acc': instance_acc, 'class_acc': class_acc,
                        'model_state_dict': classifier.module.state_dict(),
                        'optimizer_state_dict': optimizer.state_dict()}, savepath)

    logger.info('End of training...')
    dist.destroy_process_group()


if __name__ == '__main__':
    main(parse_args())
