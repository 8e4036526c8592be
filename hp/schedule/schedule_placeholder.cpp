// placeholder until the schedule room lands
