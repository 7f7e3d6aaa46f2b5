"""A plain CUDA-style PyTorch training script running on torchtpu.

The only change from its CUDA form is the device line:
    device = torch.device("cuda")   ->   device = torchtpu.get_device()
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu

device = torchtpu.get_device()


class Net(nn.Module):
    def __init__(self, num_classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 32)
        self.dropout = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        return self.fc2(x)


def make_data(n=384, num_classes=4, seed=0):
    """Synthetic 16x16 images: each class is a noisy bright quadrant."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    images = 0.3 * torch.randn(n, 1, 16, 16, generator=g)
    for c in range(num_classes):
        r, q = divmod(c, 2)
        images[labels == c, :, r * 8:(r + 1) * 8, q * 8:(q + 1) * 8] += 1.0
    return torch.utils.data.TensorDataset(images, labels)


def main(epochs=4, batch_size=64):
    torch.manual_seed(0)
    train = torch.utils.data.DataLoader(make_data(), batch_size=batch_size, shuffle=True,
                                        drop_last=True)
    test_x, test_y = make_data(128, seed=1).tensors

    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    for epoch in range(epochs):
        model.train()
        total, batches = 0.0, 0
        for images, labels in train:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        scheduler.step()

        model.eval()
        with torch.no_grad():
            pred = model(test_x.to(device)).argmax(dim=1)
            accuracy = (pred == test_y.to(device)).float().mean().item()
        print(f"epoch {epoch + 1}: loss {total / batches:.4f}  test accuracy {accuracy:.3f}")

    # The full table: torchtpu.metrics.report() (python train_cuda_script.py --report).
    print(torchtpu.metrics.report() if "--report" in sys.argv else torchtpu.metrics.summary())


if __name__ == "__main__":
    main()
