"""What is live and how a commit changes it: ring layout, episode index, snapshots, store, writer."""
